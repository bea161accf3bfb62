"""Private broadcast groups with a trainer, inside a vLLM worker.

Runs inside every vLLM worker process, mixed into EnginectlWorkerExtension. The group RPCs
(INIT_GROUP, GROUP_JOIN_STATE, DESTROY_GROUP) and the loading of received tensors run on the
worker's RPC thread, and each answers at once: joining a group (the TCPStore rendezvous, gloo's
connections, a first broadcast) runs on a thread of its own, since torch's store client retries
its connect past the timeout it is given and a worker RPC must never outlive the timeout it was
sent with (docs/architecture.md, "Worker calls and their deadlines"). The server asks how the
join stands until it ends or the caller's timeout passes; a join given up on is dropped when it
ends. One background thread per update receives broadcasts (per tensor, or per bucket of
tensors: common/buckets.py) into reusable buffers; neither thread touches the model
(worker/weights/fingerprints.py, "who may touch the weights").

What other modules use: `Group`, `Join` and `start_join` (the `gloo` transfer engine joins
its group as INIT_GROUP does: worker/weights/transfer/engine.py), `broadcast_tensors` (the
DISTRIBUTED source of a load, worker/weights/readers/broadcast.py, and of a stage),
`received_broadcast` (the one receive of both), `typed_view` and `aligned`.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from enginectl.common import buckets, dtypes
from enginectl.common.vocabulary import Reason
from enginectl.contract.engine import Cause, LoadPlan, TensorSpec, read, wire
from enginectl.contract.groups import Backend, GroupJoined, GroupSpec
from enginectl.worker.weights.channel import POLL_MS, Abort, Channel
from enginectl.worker.weights.cores import unbind_this_thread
from enginectl.worker.weights.ranks import dp_rank, global_rank

# A receive buffer's (tensor name or bucket label, dtype, shape).
BufferKey = tuple[str, str, tuple[int, ...]]


@dataclass
class Group:
    """A group this worker joined: its process group, this worker's rank in it, and the
    receive buffers its broadcasts land in."""

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


@dataclass
class Join:
    """A join running on its thread (start_join); `outcome` is set by that thread when it ends:
    the Group joined, or why not."""

    spec: GroupSpec
    dp_rank: int
    rank: int
    thread: threading.Thread | None = None
    outcome: Group | GroupJoined | None = None
    abandoned: bool = False  # given up on (destroyed, or its group exists): drop it when done

    def wait(self, timeout: float) -> Group | GroupJoined | None:
        """Wait up to `timeout` seconds for the join to end; its outcome (None: not ended)."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.outcome


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
    """Worker RPCs for update groups (the groups' broadcasts are read by broadcast_tensors)."""

    def enginectl_init_group(self, spec_wire: Any) -> Any:
        """Start joining the private group `spec` (own TCPStore + PrefixStore) on a thread;
        vLLM's own process groups are never touched. Answers at once a GroupJoined: `joining`,
        or why not (the group exists here)."""
        spec = read(GroupSpec, spec_wire)
        joins = _joins(self)
        if spec.name in _groups(self) or spec.name in joins:
            return wire(
                GroupJoined(dp_rank(self), -1, Reason.GROUP_INIT_FAILED, f"group {spec.name!r} exists on this worker")
            )
        join = joins[spec.name] = start_join(
            spec, dp_rank(self), spec.rank_offset + global_rank(self) - spec.first_worker
        )
        return wire(GroupJoined(dp_rank(self), join.rank, joining=True))

    def enginectl_group_join_state(self, name: str) -> Any:
        """How the join of `name` stands (a GroupJoined): still `joining`, the rank taken (the
        group is usable from now on), or why it failed. Answers at once."""
        groups, joins = _groups(self), _joins(self)
        join = joins.get(name)
        if join is None:
            group = groups.get(name)
            if group is not None:
                return wire(GroupJoined(dp_rank(self), group.rank))
            return wire(
                GroupJoined(dp_rank(self), -1, Reason.GROUP_INIT_FAILED, f"no join of group {name!r} on this worker")
            )
        outcome = join.outcome
        if outcome is None:
            return wire(GroupJoined(dp_rank(self), join.rank, joining=True))
        del joins[name]
        if isinstance(outcome, GroupJoined):
            return wire(outcome)
        groups[name] = outcome
        return wire(GroupJoined(dp_rank(self), outcome.rank))

    def enginectl_destroy_group(self, name: str) -> bool:
        """Leave `name`, or give up on its join (dropped when the join ends). Answers at once."""
        join = _joins(self).pop(name, None)
        if join is not None:
            join.abandoned = True
            _drop_abandoned(join)
        group = _groups(self).pop(name, None)
        if group is None:
            return join is not None
        group.buffers.clear()
        # Dropping the last reference closes gloo's connections (no collective needed).
        del group
        return True


def _groups(worker: Any) -> dict[str, Group]:
    """The groups `worker` joined, by name."""
    groups: dict[str, Group] | None = getattr(worker, "_enginectl_group_table", None)
    if groups is None:
        groups = worker._enginectl_group_table = {}
    return groups


def _joins(worker: Any) -> dict[str, Join]:
    """The joins `worker` runs (or ran, not yet asked about), by group name."""
    joins: dict[str, Join] | None = getattr(worker, "_enginectl_join_table", None)
    if joins is None:
        joins = worker._enginectl_join_table = {}
    return joins


def broadcast_tensors(worker: Any, plan: LoadPlan, channel: Channel) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors broadcast by the trainer (group rank 0) for a DISTRIBUTED load or stage, through
    the update's channel (abort frames, progress flushes, its deadline). Abort GROUP_NOT_FOUND
    at once, before any tensor, when `worker` is in no group `plan.group`."""
    group = _groups(worker).get(plan.group)
    if group is None:
        raise Abort(Cause.GROUP_NOT_FOUND, f"no update group {plan.group!r} on this worker")

    def check() -> None:
        try:
            channel.check()
        except Abort as exc:
            if exc.cause == Cause.UPDATE_TIMEOUT:  # still receiving: the broadcast is late
                raise Abort(Cause.GROUP_TIMEOUT, f"the broadcast did not complete in time: {exc}") from None
            raise

    return received_broadcast(group, plan.tensors, plan.bucket_bytes, check, channel.flush, channel.deadline)


def received_broadcast(
    group: Group,
    specs: tuple[TensorSpec, ...],
    bucket_bytes: int,
    check: Callable[[], None],
    idle: Callable[[], None],
    deadline: float,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `specs` broadcast by group rank 0, received on a thread so that receiving
    the next bucket overlaps loading this one. With `bucket_bytes` they come in buckets
    (common/buckets.py): one broadcast per bucket, into a flat receive buffer the bucket's
    tensors are views of. `check` runs between items (it raises Abort to stop), `idle` while
    nothing arrived; a failed receive raises Abort (GROUP_TIMEOUT once `deadline`, monotonic,
    passed or gloo's own timeout ran out, else STREAM_BROKEN). The one receive of enginectl's
    DISTRIBUTED loads and of its vLLM weight-transfer engine (transfer/engine.py)."""
    if group.broken:
        raise Abort(Cause.GROUP_BROKEN, group.broken)
    plan_buckets = buckets.cut([dtypes.nbytes(s.dtype, s.shape) for s in specs], bucket_bytes)
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
            check()
            try:
                item = received.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                idle()
                continue
            if item is None:
                return
            if isinstance(item, _ReceiveFailed):
                late = item.timed_out or time.monotonic() >= deadline
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


def _buffers(group: Group, specs: tuple[TensorSpec, ...], plan_buckets: list[buckets.Bucket]) -> list[torch.Tensor]:
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


def start_join(spec: GroupSpec, dp_rank: int, rank: int) -> Join:
    """Start joining the group `spec` as `rank` on a thread of its own (the one way to join:
    INIT_GROUP's and the `gloo` transfer engine's); its `outcome` says how it ended."""
    join = Join(spec, dp_rank, rank)
    join.thread = threading.Thread(target=_run_join, args=(join,), name=f"enginectl-join-{spec.name}", daemon=True)
    join.thread.start()
    return join


def _run_join(join: Join) -> None:
    """The join thread: rendezvous, connect, and a first barrier-like broadcast that proves
    every member joined. It only waits and moves bytes (worker/weights/cores.py)."""
    unbind_this_thread()
    spec = join.spec
    started = time.monotonic()
    device = "cpu"
    try:
        pg = _new_group(spec, join.rank, datetime.timedelta(seconds=spec.timeout))
        if spec.backend == Backend.NCCL:
            device = f"cuda:{torch.cuda.current_device()}"
        probe = torch.zeros(1, dtype=torch.int64, device=device)
        pg.broadcast(probe, 0).wait()
    except Exception as exc:  # noqa: BLE001 - answered as this worker's failure
        failure = (
            Cause.GROUP_TIMEOUT.value
            if _timed_out(time.monotonic() - started, spec.timeout)
            else Reason.GROUP_INIT_FAILED
        )
        join.outcome = GroupJoined(join.dp_rank, join.rank, failure, f"{type(exc).__name__}: {exc}")
        return
    join.outcome = Group(spec.name, pg, join.rank, spec.world_size, spec.timeout, device)
    _drop_abandoned(join)


def _drop_abandoned(join: Join) -> None:
    """A group joined after the server gave up on it is let go (its connections close)."""
    if join.abandoned and isinstance(join.outcome, Group):
        join.outcome = None


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
