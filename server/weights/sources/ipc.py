"""What an UpdateWeightsFromIpc request is checked for before anything is touched: the
trainer's host, and every tensor's handle against its TensorSpec.

Runs in the `enginectl serve` process, on the control loop (called from plans.py). The server
never opens a handle: only the workers map them (worker/weights/ipc.py). What can be checked
without opening one is checked here: that the trainer runs on this host (its boot id and
host name), one handle per tensor, segment names that torch makes, strides and an offset
that keep every element inside the storage, one CUDA share per engine worker.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc

from enginectl.common import dtypes
from enginectl.common.host import HostIdentity, host_identity
from enginectl.contract.engine import SHM_SEGMENT_PATTERN, CudaShare, IpcHandle
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import MAX_IPC_HANDLE_BYTES
from enginectl.server.weights.update.plans import TensorInfo
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

SEGMENT = re.compile(SHM_SEGMENT_PATTERN)
SHM_DIR = Path("/dev/shm")
LOCAL_HOST = host_identity()  # neither the boot id nor the host name changes while serving
# The IPC_HANDLE_INVALID error for a field under the handle being checked, and why.
Bad = Callable[[str, str], ControlPlaneError]


def ipc_available(local: HostIdentity = LOCAL_HOST) -> bool:
    """Whether this server can take tensors by reference: it knows its host (a Linux boot id)
    and has POSIX shared memory where torch puts it."""
    return bool(local.boot_id) and SHM_DIR.is_dir()


def check_host(host: pb2.HostIdentity, local: HostIdentity = LOCAL_HOST) -> None:
    """FAILED_PRECONDITION NOT_SAME_HOST unless `host` is this server's host."""
    trainer = HostIdentity(host.boot_id, host.hostname)
    problem = ""
    if not local.boot_id:
        problem = "this server can not tell which host it runs on (no Linux boot id)"
    elif trainer != local:
        problem = f"the trainer runs on {trainer}, the engine on {local}"
    if problem:
        raise ControlPlaneError(
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.NOT_SAME_HOST,
            f"{problem}: tensors can be passed by reference only on one host; send them over "
            "UpdateWeightsFromTensors or a broadcast group instead",
            metadata={"trainer_host": str(trainer), "server_host": str(local)},
        )


def check_ranks_local(remote_ranks: Mapping[int, str]) -> None:
    """FAILED_PRECONDITION NOT_SAME_HOST when any rank runs on another host than this server
    (`remote_ranks`: dp_rank -> its host, from the census): an IPC handle names memory of this
    host only, which a rank elsewhere can not map, so the update would write on this host's
    ranks and fail on the others (a partial update). Refused before anything is touched."""
    if not remote_ranks:
        return
    ranks = ", ".join(f"rank {rank} on {host}" for rank, host in sorted(remote_ranks.items()))
    raise ControlPlaneError(
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.NOT_SAME_HOST,
        f"IPC handles are host-local and this engine has ranks on other hosts ({ranks}): they can not map "
        "the trainer's memory. Send the tensors over UpdateWeightsFromTensors or a broadcast group instead",
        metadata={
            "remote_ranks": ",".join(str(rank) for rank in sorted(remote_ranks)),
            "remote_hosts": ",".join(sorted(set(remote_ranks.values()))),
        },
    )


def ipc_handles(
    tensors: list[TensorInfo], handles: Sequence[pb2.IpcTensorHandle], num_workers: int
) -> tuple[IpcHandle, ...]:
    """The engine contract's handles, one per tensor; IPC_HANDLE_INVALID for the first bad one."""
    if len(handles) != len(tensors):
        raise invalid_field(
            Reason.IPC_HANDLE_INVALID, "handles", f"{len(handles)} handles for {len(tensors)} tensors; one per tensor"
        )
    return tuple(
        _handle(t, h, f"handles[{i}]", num_workers) for i, (t, h) in enumerate(zip(tensors, handles, strict=True))
    )


def _handle(tensor: TensorInfo, handle: pb2.IpcTensorHandle, field: str, num_workers: int) -> IpcHandle:
    def bad(where: str, description: str) -> ControlPlaneError:
        return invalid_field(Reason.IPC_HANDLE_INVALID, f"{field}{where}", description)

    if len(handle.stride) != len(tensor.shape):
        raise bad(".stride", f"{len(handle.stride)} strides for the {len(tensor.shape)} dimensions of {tensor.name}")
    if any(s < 0 for s in handle.stride):
        raise bad(".stride", "strides must be >= 0")
    stride = tuple(int(s) for s in handle.stride)
    # The last element reached, in elements from the storage's start (none for an empty tensor).
    itemsize = dtypes.BY_NAME[tensor.dtype].itemsize
    empty = 0 in tensor.shape
    end = handle.storage_offset + sum((d - 1) * s for d, s in zip(tensor.shape, stride, strict=True)) + 1
    needed = 0 if empty else end * itemsize

    kind = handle.WhichOneof("storage")
    if kind == "shared_memory":
        memory = handle.shared_memory
        if not SEGMENT.fullmatch(memory.segment_name):
            raise bad(".shared_memory.segment_name", "a segment name torch makes: /torch_<pid>_<n>_<n>")
        _check_size(bad, ".shared_memory.storage_nbytes", memory.storage_nbytes, needed)
        return IpcHandle(handle.storage_offset, stride, memory.segment_name, memory.storage_nbytes)
    if kind == "cuda":
        shares = handle.cuda.shares
        if len(shares) != num_workers:
            raise bad(".cuda.shares", f"{len(shares)} shares; one per engine worker ({num_workers})")
        return IpcHandle(
            handle.storage_offset,
            stride,
            cuda=tuple(_share(bad, f".cuda.shares[{j}]", s, needed) for j, s in enumerate(shares)),
        )
    raise bad("", "required: shared_memory or cuda")


def _share(bad: Bad, where: str, share: pb2.CudaIpcShare, needed: int) -> CudaShare:
    if share.device < 0:
        raise bad(f"{where}.device", "a CUDA device index, >= 0")
    if not 0 < len(share.memory_handle) <= MAX_IPC_HANDLE_BYTES:
        raise bad(f"{where}.memory_handle", f"required, at most {MAX_IPC_HANDLE_BYTES} bytes")
    if len(share.event_handle) > MAX_IPC_HANDLE_BYTES:
        raise bad(f"{where}.event_handle", f"at most {MAX_IPC_HANDLE_BYTES} bytes")
    if not SEGMENT.fullmatch(share.ref_counter_handle.decode("ascii", "replace")):
        raise bad(f"{where}.ref_counter_handle", "a segment name torch makes: /torch_<pid>_<n>_<n>")
    _check_size(bad, f"{where}.storage_nbytes", share.storage_nbytes, needed)
    return CudaShare(
        share.device,
        share.memory_handle,
        share.storage_nbytes,
        share.storage_offset_bytes,
        share.ref_counter_handle,
        share.ref_counter_offset,
        share.event_handle,
        share.event_sync_required,
    )


def _check_size(bad: Bad, where: str, storage_nbytes: int, needed: int) -> None:
    if storage_nbytes < max(needed, 1):
        raise bad(
            where,
            f"the storage holds {storage_nbytes} bytes; the tensor's offset, shape and strides reach byte {needed}",
        )
