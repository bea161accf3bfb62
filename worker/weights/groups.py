"""Private broadcast groups with a trainer, inside a vLLM worker.

Runs inside every vLLM worker process, mixed into EnginectlWorkerExtension. The group RPCs
(INIT_GROUP, DESTROY_GROUP) and the loading of received tensors run on the worker's RPC
thread; one background thread per update receives broadcasts (per tensor, or per bucket of
tensors: common/buckets.py) into reusable buffers and never touches the model (worker/weights/fingerprints.py, "who may touch the weights").
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from enginectl.common import buckets, dtypes
from enginectl.contract.engine import Backend, Cause, GroupJoined, GroupSpec, LoadPlan, TensorSpec, read, wire
from enginectl.worker.weights.channel import POLL_MS, Abort, Channel
from enginectl.worker.weights.cores import unbind_this_thread, unbound
from enginectl.worker.weights.ranks import dp_rank, global_rank

GROUP_INIT_FAILED = "GROUP_INIT_FAILED"
# A receive buffer's (tensor name or bucket label, dtype, shape).
BufferKey = tuple[str, str, tuple[int, ...]]


@dataclass
class _Group:
    name: str
    pg: Any
    rank: int
    world_size: int
    timeout: float  # gloo's (or NCCL's) own bound on one collective
    device: str = "cpu"  # where receive buffers live: the worker's GPU for NCCL
    broken: str | None = None
    # Receive buffers of the last two updates' layouts (_buffers), reused: fresh pages are slow.
    buffers: dict[BufferKey, torch.Tensor] = field(default_factory=dict)
    last_layout: set[BufferKey] = field(default_factory=set)


@dataclass(frozen=True)
class _ReceiveFailed:
    """The broadcast receive thread's failure, handed to the loading thread."""

    error: BaseException
    timed_out: bool


def _timed_out(waited: float, timeout: float) -> bool:
    """gloo and the TCPStore raise the same error types for their timeout and for a dead
    peer: a failure after (nearly) the whole timeout of waiting is the timeout."""
    return waited >= 0.9 * timeout


class GroupsMixin:
    """Worker RPCs for update groups, and the broadcast source of a DISTRIBUTED load."""

    def _enginectl_groups(self) -> dict[str, _Group]:
        groups: dict[str, _Group] | None = getattr(self, "_enginectl_group_table", None)
        if groups is None:
            groups = {}
            self._enginectl_group_table = groups
        return groups

    def enginectl_init_group(self, spec_wire: Any) -> Any:
        """Join the private group `spec` (own TCPStore + PrefixStore); vLLM's own process
        groups are never touched. Answers a GroupJoined: the rank taken, or why not."""
        spec = read(GroupSpec, spec_wire)
        groups = self._enginectl_groups()
        if spec.name in groups:
            return wire(GroupJoined(dp_rank(self), -1, GROUP_INIT_FAILED, f"group {spec.name!r} exists on this worker"))
        rank = spec.rank_offset + global_rank(self)
        started = time.monotonic()
        device = "cpu"
        try:
            pg = _join(spec, rank)
            if spec.backend == Backend.NCCL:
                device = f"cuda:{torch.cuda.current_device()}"
            # A first barrier-like broadcast proves every member joined before we answer.
            probe = torch.zeros(1, dtype=torch.int64, device=device)
            pg.broadcast(probe, 0).wait()
        except Exception as exc:  # noqa: BLE001 - answered as this worker's failure
            failure = (
                Cause.GROUP_TIMEOUT.value if _timed_out(time.monotonic() - started, spec.timeout) else GROUP_INIT_FAILED
            )
            return wire(GroupJoined(dp_rank(self), rank, failure, f"{type(exc).__name__}: {exc}"))
        groups[spec.name] = _Group(spec.name, pg, rank, spec.world_size, spec.timeout, device)
        return wire(GroupJoined(dp_rank(self), rank))

    def enginectl_destroy_group(self, name: str) -> bool:
        group = self._enginectl_groups().pop(name, None)
        if group is None:
            return False
        group.buffers.clear()
        # Dropping the last reference closes gloo's connections (no collective needed).
        del group
        return True

    def _enginectl_broadcast_tensors(self, plan: LoadPlan, channel: Channel) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors broadcast by the trainer (group rank 0), received on a thread so that
        receiving the next bucket overlaps loading this one. With `plan.bucket_bytes` the
        tensors come in buckets (common/buckets.py): one broadcast per bucket, into a flat
        receive buffer the bucket's tensors are views of."""
        group = self._enginectl_groups().get(plan.group)
        if group is None:
            raise Abort(Cause.GROUP_NOT_FOUND, f"no update group {plan.group!r} on this worker")
        if group.broken:
            raise Abort(Cause.GROUP_BROKEN, group.broken)
        specs = plan.tensors
        plan_buckets = buckets.cut([dtypes.nbytes(s.dtype, s.shape) for s in specs], plan.bucket_bytes)
        # Unbounded: every bucket has a receive buffer of its own (allocated once, reused), so
        # the receive runs at the transport's pace however far the loader is behind; a bound
        # tied the two together, and each waited for the other (docs/weights.md, "Bucketed
        # broadcasts").
        received: queue.Queue[list[tuple[str, torch.Tensor]] | _ReceiveFailed | None] = queue.Queue()
        stop = threading.Event()
        receive_buffers = _buffers(group, specs, plan_buckets)

        def receive() -> None:
            unbind_this_thread()  # it only waits and moves bytes (worker/weights/cores.py)
            waiting_since = time.monotonic()
            try:
                for bucket, buffer in zip(plan_buckets, receive_buffers, strict=True):
                    waiting_since = time.monotonic()
                    group.pg.broadcast(buffer, 0).wait()
                    if bucket.packed:
                        unpacked = [
                            (specs[i].name, typed_view(buffer, offset, specs[i].dtype, specs[i].shape))
                            for i, offset in zip(range(bucket.start, bucket.stop), bucket.offsets, strict=True)
                        ]
                    else:
                        unpacked = [(specs[bucket.start].name, buffer)]
                    if stop.is_set():
                        return
                    received.put(unpacked)
                received.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
                group.broken = f"{type(exc).__name__}: {exc}"
                received.put(_ReceiveFailed(exc, _timed_out(time.monotonic() - waiting_since, group.timeout)))

        thread = threading.Thread(target=receive, name=f"enginectl-recv-{group.name}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    channel.check()
                except Abort as exc:
                    if exc.cause == Cause.UPDATE_TIMEOUT:  # still receiving: the broadcast is late
                        raise Abort(Cause.GROUP_TIMEOUT, f"the broadcast did not complete in time: {exc}") from None
                    raise
                try:
                    item = received.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    channel.flush()
                    continue
                if item is None:
                    return
                if isinstance(item, _ReceiveFailed):
                    late = item.timed_out or time.time() >= channel.deadline
                    raise Abort(
                        Cause.GROUP_TIMEOUT if late else Cause.STREAM_BROKEN,
                        f"the broadcast failed: {type(item.error).__name__}: {item.error}",
                    )
                yield from item
        finally:
            stop.set()
            if thread.is_alive():
                # Blocked in a receive: the group can not be trusted again; the server destroys it.
                group.broken = group.broken or "an update stopped while receiving through this group"


def _buffer_key(specs: tuple[TensorSpec, ...], bucket: buckets.Bucket) -> BufferKey:
    """Which receive buffer `bucket` uses: the tensor itself for a bucket of one, a flat
    uint8 buffer otherwise."""
    if bucket.packed:
        return (f"bucket:{specs[bucket.start].name}:{bucket.stop - bucket.start}", "uint8", (bucket.nbytes,))
    spec = specs[bucket.start]
    return (spec.name, spec.dtype, spec.shape)


def _buffers(group: _Group, specs: tuple[TensorSpec, ...], plan_buckets: list[buckets.Bucket]) -> list[torch.Tensor]:
    """The receive buffer of every bucket, reused across updates (fresh pages are slow to
    fill). Buffers of this layout and of the one before it are kept (a trainer alternating
    two layouts reallocates nothing; a lone tensor's buffer serves both), older ones are
    dropped. Allocated here, filled by the receiving thread."""
    keys = [_buffer_key(specs, bucket) for bucket in plan_buckets]
    for key in keys:
        if key not in group.buffers:
            group.buffers[key] = torch.empty(key[2], dtype=getattr(torch, key[1]), device=group.device)
    keep = set(keys) | group.last_layout
    for key in [key for key in group.buffers if key not in keep]:
        del group.buffers[key]
    group.last_layout = set(keys)
    return [group.buffers[key] for key in keys]


def typed_view(buffer: torch.Tensor, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes start at `offset` of the uint8 `buffer`:
    a view when the offset is aligned to the element size, else (a packed 1-byte tensor of odd
    size before it) a copy."""
    raw = buffer[offset : offset + dtypes.nbytes(dtype, shape)]
    if not aligned(offset, dtype):
        raw = raw.clone()
    return raw.view(getattr(torch, dtype)).reshape(shape)


def aligned(offset: int, dtype: str) -> bool:
    """Whether a tensor of `dtype` whose bytes start at `offset` can be a view (typed_view)."""
    return offset % getattr(torch, dtype).itemsize == 0


def _join(spec: GroupSpec, rank: int) -> Any:
    """The process group `spec` with this worker as `rank` (blocks until every member joined,
    or the timeout)."""
    timeout = datetime.timedelta(seconds=spec.timeout)
    with unbound():  # the store's and gloo's I/O threads start here, and move bytes only
        return _new_group(spec, rank, timeout)


def _new_group(spec: GroupSpec, rank: int, timeout: datetime.timedelta) -> Any:
    store = torch.distributed.TCPStore(
        spec.master_address,
        spec.master_port,
        spec.world_size,
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = torch.distributed.PrefixStore(f"enginectl/{spec.name}", store)
    if spec.backend == Backend.NCCL:
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
