"""The one dtype table: every tensor dtype enginectl moves, by its torch name.

Torch-free, so the client, the server and the workers share it: the proto enum a trainer
sends (`TensorDtype`), the safetensors code a checkpoint header names, and the size of one
element. The worker maps a name to a torch dtype with `getattr(torch, name)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from enginectl.weights.v1 import weight_update_service_pb2 as pb2


@dataclass(frozen=True)
class Dtype:
    name: str  # torch's name without "torch.", e.g. "bfloat16"
    proto: pb2.TensorDtype.ValueType
    safetensors: str  # the dtype code in a safetensors header, e.g. "BF16"
    itemsize: int
    floating: bool


_TABLE: Final = (
    Dtype("float32", pb2.TENSOR_DTYPE_FLOAT32, "F32", 4, True),
    Dtype("float16", pb2.TENSOR_DTYPE_FLOAT16, "F16", 2, True),
    Dtype("bfloat16", pb2.TENSOR_DTYPE_BFLOAT16, "BF16", 2, True),
    Dtype("float64", pb2.TENSOR_DTYPE_FLOAT64, "F64", 8, True),
    Dtype("int8", pb2.TENSOR_DTYPE_INT8, "I8", 1, False),
    Dtype("int16", pb2.TENSOR_DTYPE_INT16, "I16", 2, False),
    Dtype("int32", pb2.TENSOR_DTYPE_INT32, "I32", 4, False),
    Dtype("int64", pb2.TENSOR_DTYPE_INT64, "I64", 8, False),
    Dtype("uint8", pb2.TENSOR_DTYPE_UINT8, "U8", 1, False),
    Dtype("bool", pb2.TENSOR_DTYPE_BOOL, "BOOL", 1, False),
    Dtype("float8_e4m3fn", pb2.TENSOR_DTYPE_FLOAT8_E4M3FN, "F8_E4M3", 1, False),
    Dtype("float8_e5m2", pb2.TENSOR_DTYPE_FLOAT8_E5M2, "F8_E5M2", 1, False),
)

BY_NAME: Final = {d.name: d for d in _TABLE}
BY_PROTO: Final = {d.proto: d for d in _TABLE}
BY_SAFETENSORS: Final = {d.safetensors: d for d in _TABLE}


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of `dtype` (a name of this table) and `shape`."""
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * BY_NAME[dtype].itemsize
