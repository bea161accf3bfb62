"""Tensors for the trainer client: specs, raw stream bytes, the tensor stream, and the
trainer's side of a group.

Runs in the trainer process. Needs torch, imported lazily inside the functions, so that
`enginectl.client` stays importable without it. Names are checkpoint names (what the
model's safetensors files hold); `nn.Module.state_dict()` of a Hugging Face model gives them.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from enginectl.client.client import Connection
from enginectl.client.errors import from_rpc_error
from enginectl.client.trainer_requests import UpdateOptions, duration
from enginectl.client.trainer_types import UpdateOperation
from enginectl.common import dtypes
from enginectl.common.buckets import Bucket, cut
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

BACKENDS = {"gloo": pb2.GROUP_BACKEND_GLOO, "nccl": pb2.GROUP_BACKEND_NCCL}
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024  # a tensor stream's chunk
# Broadcasts pack tensors of at most this size into buckets (one collective per bucket).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

# Anything naming tensors: an nn.Module, a state dict, or (name, tensor) pairs.
TensorSource = Any


def named_tensors(source: TensorSource, device: str | None = "cpu") -> list[tuple[str, Any]]:
    """(checkpoint name, detached contiguous tensor on `device`) pairs, in `source` order;
    with `device` None, each tensor detached as it is (no copy: trainer_ipc.py)."""
    import torch

    if isinstance(source, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = source.state_dict().items()
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    out = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        detached = tensor.detach()
        out.append((str(name), detached if device is None else detached.to(device).contiguous()))
    return out


def tensor_spec(name: str, tensor: Any) -> pb2.TensorSpec:
    """The TensorSpec (checkpoint name, dtype as sent, full shape) of one tensor."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    known = dtypes.BY_NAME.get(dtype)
    if known is None:
        raise TypeError(f"{name!r}: dtype {dtype} can not be sent (known: {', '.join(dtypes.BY_NAME)})")
    return pb2.TensorSpec(name=name, dtype=known.proto, shape=list(tensor.shape))


def raw_bytes(tensor: Any) -> memoryview:
    """The tensor's raw little-endian, C-contiguous bytes (no copy for a contiguous CPU tensor)."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("the tensor stream carries little-endian bytes; this host is big-endian")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def chunks(named: list[tuple[str, Any]], chunk_bytes: int) -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
    """Stream messages after the header: the tensors' bytes concatenated, cut in chunks of
    `chunk_bytes` (the last one shorter), each with its running offset."""
    offset = 0
    pending = bytearray()
    for _, tensor in named:
        view = raw_bytes(tensor)
        while len(view):
            if not pending and len(view) >= chunk_bytes:
                data, view = bytes(view[:chunk_bytes]), view[chunk_bytes:]
            else:
                take = min(len(view), chunk_bytes - len(pending))
                pending += view[:take]
                view = view[take:]
                if len(pending) < chunk_bytes:
                    continue
                data, pending = bytes(pending), bytearray()
            yield pb2.UpdateWeightsFromTensorsRequest(chunk=pb2.TensorStreamChunk(offset=offset, data=data))
            offset += len(data)
    if pending:
        yield pb2.UpdateWeightsFromTensorsRequest(chunk=pb2.TensorStreamChunk(offset=offset, data=bytes(pending)))


class TensorStream:
    """UpdateWeightsFromTensors on one connection: the header, then every byte."""

    def __init__(self, connection: Connection, stub: pb2_grpc.WeightUpdateServiceStub) -> None:
        self._connection, self._stub = connection, stub

    async def start(self, tensors: TensorSource, options: UpdateOptions, chunk_bytes: int) -> UpdateOperation:
        """Send `tensors` in chunks of `chunk_bytes`; the Operation the stream started."""
        if not 0 < chunk_bytes <= 4 * 1024 * 1024:
            raise ValueError("chunk_bytes must be in 1..4 MiB")
        named = named_tensors(tensors)
        header = options.fill(pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named]))

        def messages() -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
            yield pb2.UpdateWeightsFromTensorsRequest(header=header)
            yield from chunks(named, chunk_bytes)

        try:
            response = await self._stub.UpdateWeightsFromTensors(
                messages(), timeout=options.wait_bound(), metadata=self._connection.config.metadata()
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return UpdateOperation.from_proto(response)


class BroadcastGroup:
    """The trainer's membership (rank 0) of a private update group; it hosts the TCPStore.

    `host` opens the store at once (engine workers connect to it); `join` blocks until every
    member created its process group, then matches the workers' probe broadcast.
    """

    def __init__(self, name: str, backend: str, store: Any, world_size: int, timeout: float) -> None:
        self.name, self.backend, self.store = name, backend, store
        self.world_size, self.timeout = world_size, timeout
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.pg: Any = None
        self.broken = ""
        self._staging: Any = None  # the packing buffer of bucketed broadcasts, reused
        self._lock = threading.Lock()

    @classmethod
    def host(cls, name: str, backend: str, address: str, port: int, world_size: int, timeout: float) -> BroadcastGroup:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, not {backend!r}")
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        return cls(name, backend, store, world_size, timeout)

    @property
    def port(self) -> int:
        return int(self.store.port)

    def join_request(self, master_address: str, rank_offset: int) -> pb2.InitWeightsUpdateGroupRequest:
        """The InitWeightsUpdateGroup request that has a server's workers join this group, as
        ranks rank_offset.., at its store on master_address."""
        return pb2.InitWeightsUpdateGroupRequest(
            group_name=self.name,
            master_address=master_address,
            master_port=self.port,
            rank_offset=rank_offset,
            world_size=self.world_size,
            backend=BACKENDS[self.backend],
            timeout=duration(self.timeout),
        )

    def join(self) -> None:
        """Create rank 0's process group (blocks until all members joined) and answer the probe."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout)
        prefixed = dist.PrefixStore(f"enginectl/{self.name}", self.store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(prefixed, 0, self.world_size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, 0, self.world_size, timeout)
        pg.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device), 0).wait()
        self.pg = pg

    def broadcast(
        self, tensors: list[Any], plan_buckets: Iterable[Bucket] | None = None, stop: threading.Event | None = None
    ) -> int:
        """Broadcast `tensors` from rank 0 in order, one collective per bucket of
        `plan_buckets` (common/buckets.py; None: one per tensor); returns how many tensors
        were sent. Stops early, between buckets, when `stop` is set. A failure marks the
        group broken (it can not be reused)."""
        if self.pg is None or self.broken:
            raise RuntimeError(f"group {self.name!r} is not usable: {self.broken or 'not joined'}")
        if plan_buckets is None:
            plan_buckets = cut([0] * len(tensors), 0)
        sent = 0
        with self._lock:
            try:
                for bucket in plan_buckets:
                    if stop is not None and stop.is_set():
                        break
                    if bucket.packed:
                        self.pg.broadcast(self._pack(tensors[bucket.start : bucket.stop], bucket.nbytes), 0).wait()
                    else:
                        self.pg.broadcast(tensors[bucket.start], 0).wait()
                    sent += bucket.stop - bucket.start
            except BaseException as exc:
                self.broken = f"{type(exc).__name__}: {exc}"
                raise
        return sent

    def _pack(self, tensors: list[Any], nbytes: int) -> Any:
        """`tensors`' raw bytes back to back in one uint8 buffer on the group's device, reused
        by every bucket (each broadcast completes before the next packs: gloo's wait blocks,
        and on NCCL the copy is queued on the stream after the broadcast)."""
        import torch

        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        flat = self._staging[:nbytes]
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors], out=flat)
        return flat

    def abandon(self, why: str) -> None:
        """Mark the group broken (its first reason kept) and close it: after a broadcast that
        failed or was cut short, its collectives can not be trusted."""
        self.broken = self.broken or why
        self.close()

    def close(self) -> None:
        """Drop the process group and the store (closes their connections)."""
        self.pg = None
        self.store = None
        self._staging = None
