"""Raw UpdateWeightsFromTensors streams, built message by message: what the malformed-stream
tests send around the trainer client, which would refuse to build them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from support.serving import ServeProcess

from enginectl.client import EnginectlError
from enginectl.client.errors import from_rpc_error
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


def stream(server: ServeProcess, messages: list[pb2.UpdateWeightsFromTensorsRequest]) -> EnginectlError:
    """Send `messages` raw over UpdateWeightsFromTensors; the error it ends with."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb2_grpc.WeightUpdateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeightsFromTensors(iter(messages), timeout=120)
    return from_rpc_error(err.value)


def header(state: dict[str, Any], **fields: Any) -> pb2.UpdateWeightsFromTensorsRequest:
    from enginectl.client.trainer_tensors import tensor_spec

    return pb2.UpdateWeightsFromTensorsRequest(
        header=pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in state.items()], **fields)
    )


def chunk(offset: int, data: bytes) -> pb2.UpdateWeightsFromTensorsRequest:
    return pb2.UpdateWeightsFromTensorsRequest(chunk=pb2.TensorStreamChunk(offset=offset, data=data))
