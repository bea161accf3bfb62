"""Same-host weight updates by reference: the trainer's side of UpdateWeightsFromIpc.

Runs in the trainer process. `IpcUpdates` is `AsyncTrainerClient.update_weights_from_ipc`
(forwarded to it) and `update_weights_from_tensors(..., zero_copy=True)` (client/trainer.py).
Each tensor is sent as a handle to memory torch shares, never as bytes, and nothing is
pickled:

- a CPU tensor's storage is moved into a POSIX shared-memory segment by torch's "file_system"
  sharing (`untyped_storage()._share_filename_cpu_()`): once, in place, on first use; later
  updates of the same storage send the same segment without copying;
- a CUDA tensor's storage is shared with CUDA IPC (`untyped_storage()._share_cuda_()`), once
  per engine worker, since each worker releases the share it maps.

The engine's workers map the memory and read it while the update runs, so the trainer must
keep every tensor alive and unchanged until the Operation is done: `IpcUpdates` waits for it,
and cancels it if the wait itself is cancelled. torch is imported lazily.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, Any

from enginectl.client.errors import FailedPreconditionError, Reason, UnimplementedError
from enginectl.client.trainer_operations import UpdateOperations
from enginectl.client.trainer_requests import UpdateOptions
from enginectl.client.trainer_tensors import TensorSource, named_tensors, tensor_spec
from enginectl.client.trainer_types import TrainerCalls, UpdateOperation, UpdateResult
from enginectl.common.host import host_identity
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


def is_local_target(target: str) -> bool:
    """Whether the gRPC `target` names this host: a unix socket, `localhost` or a loopback
    address (127.0.0.0/8, ::1), with or without a port or a name-resolver scheme."""
    target = target.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if target.startswith(scheme):
            target = target[len(scheme) :].rsplit("/", 1)[-1]  # dns://resolver/host:port
            break
    addresses = [a.strip() for a in target.split(",")]  # ipv4:a:1,b:2 lists several
    return bool(addresses) and all(_is_loopback(_host_of(a)) for a in addresses)


def _host_of(address: str) -> str:
    if address.startswith("["):  # [::1]:50051
        return address[1:].split("]", 1)[0]
    if address.count(":") == 1:  # host:port
        return address.split(":", 1)[0]
    return address  # a bare host, or a bare IPv6 address


def _is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def ipc_request(named: list[tuple[str, Any]], num_workers: int) -> pb2.UpdateWeightsFromIpcRequest:
    """The request for `named` (name, tensor) pairs: a spec and a handle per tensor, and this
    host. Shares every storage that is not shared yet (see the module docstring)."""
    identity = host_identity()
    request = pb2.UpdateWeightsFromIpcRequest(
        host=pb2.HostIdentity(boot_id=identity.boot_id, hostname=identity.hostname)
    )
    for name, tensor in named:
        request.tensors.append(tensor_spec(name, tensor))
        request.handles.append(_handle(name, tensor, num_workers))
    return request


def _handle(name: str, tensor: Any, num_workers: int) -> pb2.IpcTensorHandle:
    import torch

    if tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name!r}: a {tensor.device.type} {tensor.layout} tensor can not be shared by reference; "
            "send dense CPU or CUDA tensors, or use update_weights_from_tensors"
        )
    handle = pb2.IpcTensorHandle(storage_offset=tensor.storage_offset(), stride=list(tensor.stride()))
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu":
        try:
            _manager, segment, nbytes = storage._share_filename_cpu_()
        except RuntimeError as exc:
            raise ValueError(f"{name!r} can not be moved into shared memory ({exc}); send a .clone()") from None
        handle.shared_memory.segment_name = segment.decode()
        handle.shared_memory.storage_nbytes = nbytes
        return handle
    for _ in range(num_workers):  # one share per worker: each releases the one it maps
        device, memory, nbytes, offset, counter, counter_offset, event, sync = storage._share_cuda_()
        handle.cuda.shares.append(
            pb2.CudaIpcShare(
                device=device,
                memory_handle=memory,
                storage_nbytes=nbytes,
                storage_offset_bytes=offset,
                ref_counter_handle=counter,
                ref_counter_offset=counter_offset,
                event_handle=event or b"",
                event_sync_required=bool(sync),
            )
        )
    return handle


class IpcUpdates:
    """UpdateWeightsFromIpc for one trainer client: the update, waited for, and the zero-copy
    path of its tensor updates."""

    def __init__(
        self, client: TrainerCalls, stub: pb2_grpc.WeightUpdateServiceStub, operations: UpdateOperations
    ) -> None:
        self._client, self._connection, self._stub = client, client.connection, stub
        self._operations = operations

    async def update_weights_from_ipc(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
    ) -> UpdateResult:
        """Load CPU or CUDA `tensors` (as update_weights_from_tensors) by reference, for a
        server on this host: UpdateWeightsFromIpc (trainer_ipc.py). CPU tensors move into
        shared memory on first use (once, in place). Waits for the update, since the engine
        reads the tensors until it ends: keep them alive and unchanged until this returns."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        return await self.update(tensors, options, progress)

    async def update(self, tensors: TensorSource, options: UpdateOptions, progress: bool) -> UpdateResult:
        """UpdateWeightsFromIpc for `tensors`, waited for; its UpdateResult, or its error raised."""
        named = named_tensors(tensors, device=None)  # held until the Operation is done
        cuda = any(t.device.type == "cuda" for _, t in named)
        num_workers = (await self._client.get_server_info()).num_workers if cuda else 0
        # Off the event loop: the first share of a CPU storage copies it into shared memory.
        request = options.fill(await asyncio.to_thread(ipc_request, named, num_workers))
        started = await self._connection.unary(self._stub.UpdateWeightsFromIpc, request, None)
        op = UpdateOperation.from_proto(started)
        try:
            done = await self._operations.until_done(op.name, options.wait_bound(), progress)
        except BaseException:
            # The engine may still be reading these tensors: stop it before they can change.
            await asyncio.shield(self._cancel_quietly(op.name))
            raise
        return done.result()

    async def zero_copy(
        self, tensors: TensorSource, options: UpdateOptions, progress: bool, wait: bool
    ) -> UpdateResult | None:
        """`update` when the server is on this host; None (send the bytes instead) when its
        target is not local, or when it refuses by-reference updates before starting one
        (UNIMPLEMENTED: an older server; NOT_SAME_HOST: e.g. a port forwarded into a
        container). Always waits for the update: `wait` False is a ValueError."""
        if not wait:
            raise ValueError("zero_copy waits for the update (the engine reads the tensors until it ends)")
        if not is_local_target(self._connection.config.target):
            return None
        try:
            return await self.update(tensors, options, progress)
        except UnimplementedError:
            return None
        except FailedPreconditionError as err:
            if err.reason == Reason.NOT_SAME_HOST:
                return None
            raise

    async def _cancel_quietly(self, name: str) -> None:
        try:
            await self._operations.cancel_operation(name)
        except Exception:  # noqa: BLE001 - best effort: the update's own timeout still bounds it
            pass
