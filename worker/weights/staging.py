"""Two-phase updates inside a vLLM worker: stage while generation goes on, load from memory
at commit.

Runs inside every vLLM worker process, mixed into EnginectlWorkerExtension. Threads (the rule
of worker/weights/fingerprints.py, "who may touch the weights"):
- STAGE runs on the worker's RPC thread only long enough to lay out the staging buffer and
  start one **staging thread**, then answers: generation goes on at once.
- The staging thread receives the update's bytes (disk files, tensor-stream chunks or a
  broadcast) into the staging buffer, then digests them. It never touches the model: only
  that buffer, the update's ZMQ channel (handed over to it, used by no other thread) and,
  for a broadcast, the group's receive thread.
- The commit is an ordinary LOAD of Source.STAGED on the RPC thread: `reload_weights` over
  views of the staging buffer (`staged_tensors`, read by worker/weights/readers/staged.py),
  under the weight guard, as every load.

The staging buffer holds the tensors' bytes back to back in plan order (the tensor stream's
own layout, so its chunks land in place), and is kept for the next stage: fresh pages fill
far slower than reused ones (docs/weights.md, "Two-phase updates"; the measurement is in
bench/README.md, "Measurements behind the constants").
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from enginectl.common import dtypes
from enginectl.common.safetensors_header import parse_header
from enginectl.contract import frames
from enginectl.contract.engine import (
    Cause,
    LoadError,
    LoadPlan,
    Source,
    StageAck,
    StageResult,
    TensorSpec,
    read,
    wire,
)
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.cores import unbind_this_thread
from enginectl.worker.weights.groups import broadcast_tensors, typed_view
from enginectl.worker.weights.ranks import dp_rank, place

STAGED_SEND_TIMEOUT_MS = 10_000  # the `staged` report waits this long for a slow server
# Fault injection for tests only, for faults no real input causes on demand; a comma list:
# "commit-once": this worker's first commit fails half-way (after writing began);
# "commit-N": its Nth commit does (N from 1; several may be listed);
# "report-lost-once": its first stage never sends its `staged` report (one lost in transit).
FAULT_ENV = "ENGINECTL_TEST_FAULT"


@dataclass
class Staged:
    """One staged set on this worker."""

    token: str
    source: Source
    specs: tuple[TensorSpec, ...]
    offsets: list[int]
    buffer: torch.Tensor  # uint8, exactly the set's bytes
    # The tensors a commit loads: views of `buffer` made by the staging thread once every
    # byte arrived (inside vLLM's reload each torch call costs several times more).
    views: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    result: StageResult | None = None  # set by the staging thread when it ends


@dataclass
class StagingState:
    current: Staged | None = None
    buffer: torch.Tensor | None = None  # kept for reuse across stages
    committed: bool = False  # a commit loaded from `buffer` since it was last (re)used
    faults_fired: set[str] = field(default_factory=set)  # FAULT_ENV
    commits: int = 0  # commits this worker began (FAULT_ENV's "commit-N")


class StagingMixin:
    """Worker RPCs of two-phase updates (see the module docstring)."""

    def enginectl_stage(self, plan_wire: Any) -> Any:
        """Start staging `plan` on a background thread; answers a StageAck at once. The
        thread reports `frames.staged` on the progress channel when it ends."""
        plan = read(LoadPlan, plan_wire)
        where = place(self)
        rank, worker = where.dp_rank, where.worker_rank
        state = staging_state(self)
        _drop(state, free=False)  # the server keeps one set; a set it lost track of goes
        if state.committed:
            release_if_kept(self, state)
        offsets, total = _layout(plan.tensors)
        buffer = _buffer(state, total)
        staged = state.current = Staged(plan.stage_token, plan.source, plan.tensors, offsets, buffer)
        channel = Channel(plan, where)  # from here on used by the staging thread only
        # A broadcast's tensors are received lazily, on the staging thread.
        source = broadcast_tensors(self, plan, channel) if plan.source == Source.DISTRIBUTED else None
        thread = threading.Thread(
            target=_stage,
            args=(staged, source, plan.files, channel, rank, worker, _fault(state, "report-lost-once")),
            name=f"enginectl-stage-{plan.stage_token[:8]}",
            daemon=True,
        )
        staged.thread = thread
        thread.start()
        return wire(StageAck(rank, worker))

    def enginectl_stage_result(self, token: str) -> Any:
        """How this worker's staging of `token` ended (done False while it still runs)."""
        rank, worker = dp_rank(self), int(self.rank)  # type: ignore[attr-defined]
        staged = staging_state(self).current
        if staged is None or staged.token != token:
            error = LoadError(Cause.LOAD_FAILED, "no staged set of that name on this worker")
            return wire(StageResult(rank, worker, done=True, error=error))
        return wire(staged.result or StageResult(rank, worker, done=False))

    def enginectl_discard_staged(self, token: str, free: bool) -> int:
        """Drop the staged set `token` (a staging thread still running stops at its next
        tensor or chunk); `free` also releases the buffer instead of keeping it for the next
        stage. Answers the bytes the set held (0: no such set)."""
        state = staging_state(self)
        if state.current is None or state.current.token != token:
            return 0
        return _drop(state, free)


def staging_state(worker: Any) -> StagingState:
    """`worker`'s staging state (its staged set and kept buffer), made on first use."""
    state: StagingState | None = getattr(worker, "_enginectl_staging_state", None)
    if state is None:
        state = worker._enginectl_staging_state = StagingState()
    return state


def staged_tensors(state: StagingState, token: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A commit's tensors: views of the staged set `token` (Abort before the first tensor when
    this worker has no complete set of that name)."""
    staged = state.current
    if staged is None or staged.token != token:
        raise Abort(Cause.LOAD_FAILED, "no staged set of that name on this worker")
    if staged.result is None or not staged.result.done or staged.result.error is not None:
        raise Abort(Cause.LOAD_FAILED, "the staged set on this worker is not complete")
    state.commits += 1
    fault = _fault(state, "commit-once") or _fault(state, f"commit-{state.commits}")
    for i, pair in enumerate(staged.views):
        if fault and i == len(staged.views) // 2:
            raise RuntimeError(f"injected commit fault ({FAULT_ENV})")
        yield pair


def release_if_kept(worker: Any, state: StagingState) -> None:
    """If the model kept a view of the staging buffer instead of copying (a loader that
    assigns `param.data`), the buffer is the model's now and must never be written by a
    later stage: it is let go of (the model's tensors keep it alive). Called on the RPC
    thread before a buffer a commit loaded from (`state.committed`) is reused."""
    state.committed = False
    if state.buffer is None:
        return
    start = state.buffer.untyped_storage().data_ptr()
    end = start + state.buffer.untyped_storage().nbytes()
    model = worker.model_runner.get_model()
    for tensor in model.state_dict(keep_vars=True).values():
        if tensor.device.type == "cpu" and start <= tensor.untyped_storage().data_ptr() < end:
            state.buffer = None  # the staged set keeps its own reference
            return


def _fault(state: StagingState, name: str) -> bool:
    """Whether the injected fault `name` fires now (once per worker; FAULT_ENV)."""
    if name not in os.environ.get(FAULT_ENV, "").split(",") or name in state.faults_fired:
        return False
    state.faults_fired.add(name)
    return True


def _layout(specs: tuple[TensorSpec, ...]) -> tuple[list[int], int]:
    """Byte offsets of `specs` back to back, and their total."""
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += dtypes.nbytes(spec.dtype, spec.shape)
    return offsets, total


def _buffer(state: StagingState, size: int) -> torch.Tensor:
    """`size` bytes of the kept staging buffer (grown when too small); pinned where CUDA is,
    so a commit copies to the GPU at full speed."""
    if state.buffer is None or state.buffer.numel() < size:
        state.buffer = None  # free the old one before allocating the new
        state.buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return state.buffer[:size]


def drop_staged(state: StagingState) -> None:
    """Drop the set staged before, keeping the buffer for the next (a transfer round that
    stages: transfer/steps.py)."""
    _drop(state, free=False)


def _drop(state: StagingState, free: bool) -> int:
    staged, state.current = state.current, None
    nbytes = 0
    if staged is not None:
        staged.stop.set()
        nbytes = staged.buffer.numel()
        if staged.thread is not None and staged.thread.is_alive():
            # It stops at its next tensor or chunk, and may write until then: the next stage
            # gets a buffer of its own (this one goes with that thread).
            state.buffer = None
    if free:
        state.buffer = None
    return nbytes


def _stage(
    staged: Staged,
    source: Iterator[tuple[str, torch.Tensor]] | None,
    files: tuple[str, ...],
    channel: Channel,
    rank: int,
    worker: int,
    lose_report: bool = False,
) -> None:
    """The staging thread: receive every tensor into the buffer, digest it, report
    (`lose_report`: an injected fault, FAULT_ENV). Not bound to the worker's cores: it runs
    beside generation, not between its steps (worker/weights/cores.py)."""
    unbind_this_thread()
    total = staged.buffer.numel()
    try:
        if staged.source == Source.TENSORS:
            _receive_stream(staged, channel)
        elif staged.source == Source.DISK:
            _read_files(staged, files, channel)
        elif source is not None:
            _copy_tensors(staged, source, channel)
        else:
            raise Abort(Cause.LOAD_FAILED, f"{staged.source.value} updates can not be staged")
        result = completed(staged, rank, worker)
    except Abort as exc:
        result = StageResult(rank, worker, done=True, error=LoadError(exc.cause, str(exc)))
    except Exception as exc:  # noqa: BLE001 - a broken sender, a truncated file, ...
        cause = Cause.STREAM_BROKEN if staged.source == Source.DISTRIBUTED else Cause.LOAD_FAILED
        result = StageResult(rank, worker, done=True, error=LoadError(cause, f"{type(exc).__name__}: {exc}"))
    staged.result = result
    linger_ms = 0
    try:
        if result.error is None:
            channel.progress(len(staged.specs), total, force=True)
        channel.progress_socket.setsockopt(zmq.SNDTIMEO, STAGED_SEND_TIMEOUT_MS)
        if not lose_report:
            channel.progress_socket.send(frames.staged(rank, worker, channel.key))
        # send() only queues the frame: closed with LINGER 0, the socket would drop what its
        # I/O thread has not written yet, and the server would wait for a report never sent.
        linger_ms = STAGED_SEND_TIMEOUT_MS
    except zmq.ZMQError:
        pass  # the server went away or stopped listening: it asks for the StageResult instead
    finally:
        channel.close(linger_ms)


def completed(staged: Staged, rank: int, worker: int) -> StageResult:
    """Every byte of `staged` arrived: its digest, the typed views a commit loads, and the
    StageResult that says so (Abort when it was discarded meanwhile)."""
    digest = _digest(staged)
    staged.views = [
        (spec.name, typed_view(staged.buffer, offset, spec.dtype, spec.shape))
        for spec, offset in zip(staged.specs, staged.offsets, strict=True)
    ]
    return StageResult(rank, worker, done=True, tensors=len(staged.specs), nbytes=staged.buffer.numel(), digest=digest)


def _check(staged: Staged, channel: Channel) -> None:
    if staged.stop.is_set():
        raise Abort(Cause.UPDATE_CANCELLED, "the staged set was discarded while it was received")
    channel.check()


def _copy_tensors(staged: Staged, source: Iterator[tuple[str, torch.Tensor]], channel: Channel) -> None:
    """Disk or broadcast tensors, each copied into its place (a disk file's order may differ
    from the plan's: tensors are placed by name)."""
    index = {spec.name: i for i, spec in enumerate(staged.specs)}
    seen: set[int] = set()
    nbytes = 0
    for name, tensor in source:
        _check(staged, channel)
        i = index.get(name)
        if i is None or i in seen:
            raise Abort(Cause.LOAD_FAILED, f"{name}: not in the update's tensors, or twice")
        size = dtypes.nbytes(staged.specs[i].dtype, staged.specs[i].shape)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != size:
            raise Abort(Cause.DATA_SIZE_MISMATCH, f"{name}: {data.numel()} bytes; its spec holds {size}")
        _copy(staged, staged.offsets[i], data.numpy())
        seen.add(i)
        nbytes += size
        channel.progress(len(seen), nbytes)
    _all_arrived(staged, seen)


def _receive_stream(staged: Staged, channel: Channel) -> None:
    """Tensor-stream chunks straight into the buffer (the stream's layout is the buffer's)."""
    total, received, complete = staged.buffer.numel(), 0, 0
    while received < total:
        _check(staged, channel)
        chunk = channel.recv()  # an abort (a short stream, CancelOperation, a timeout) raises
        _copy(staged, chunk.offset, np.frombuffer(chunk.data, dtype=np.uint8))
        received = chunk.offset + len(chunk.data)
        while complete < len(staged.specs) and _end(staged, complete) <= received:
            complete += 1
        channel.progress(complete, received)


def _copy(staged: Staged, offset: int, data: np.ndarray) -> None:
    """`data` into the buffer at `offset`: numpy's copy releases the GIL and uses no thread
    pool (torch's copy_ would run on the intra-op threads the model's forward pass uses)."""
    np.copyto(staged.buffer.numpy()[offset : offset + data.size], data)


READ_BYTES = 8 << 20  # a disk stage reads this much per call (stop and abort checks between)


def _read_files(staged: Staged, files: tuple[str, ...], channel: Channel) -> None:
    """A disk stage: every tensor's bytes read from the safetensors files straight into its
    place in the buffer (one copy, from the page cache; the read releases the GIL). The
    server checked the headers; they are parsed again here (common/safetensors_header.py),
    and the sizes checked against the update's tensors."""
    index = {spec.name: i for i, spec in enumerate(staged.specs)}
    buffer = staged.buffer.numpy()
    done: set[int] = set()
    nbytes = 0
    for file in files:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            entries = parse_header(f.read(length), os.path.basename(file))
            base = 8 + length
            for entry in entries:
                name = entry.name
                i = index.get(name)
                if i is None or i in done:
                    raise Abort(Cause.LOAD_FAILED, f"{name}: in {file} but not in the update's tensors, or twice")
                size = dtypes.nbytes(staged.specs[i].dtype, staged.specs[i].shape)
                if entry.end - entry.begin != size:
                    raise Abort(
                        Cause.DATA_SIZE_MISMATCH,
                        f"{name}: {entry.end - entry.begin} bytes in {file}; its spec holds {size}",
                    )
                position = staged.offsets[i]
                while position < staged.offsets[i] + size:
                    _check(staged, channel)
                    count = min(READ_BYTES, staged.offsets[i] + size - position)
                    target = memoryview(buffer[position : position + count])  # type: ignore[arg-type]
                    got = os.preadv(f.fileno(), [target], base + entry.begin + position - staged.offsets[i])
                    if got <= 0:
                        raise Abort(Cause.LOAD_FAILED, f"{file} ends inside {name}")
                    position += got
                done.add(i)
                nbytes += size
                channel.progress(len(done), nbytes)
    _all_arrived(staged, done)


def _all_arrived(staged: Staged, arrived: set[int]) -> None:
    if len(arrived) != len(staged.specs):
        missing = next(spec.name for i, spec in enumerate(staged.specs) if i not in arrived)
        raise Abort(Cause.LOAD_FAILED, f"{len(staged.specs) - len(arrived)} tensor(s) never arrived, e.g. {missing}")


def _end(staged: Staged, i: int) -> int:
    return staged.offsets[i] + dtypes.nbytes(staged.specs[i].dtype, staged.specs[i].shape)


def _digest(staged: Staged) -> str:
    """The staged bytes' digest (contract STAGED_DIGEST_METHOD): each tensor's name, dtype,
    shape and CRC32 (zlib releases the GIL on large buffers) folded into blake2b."""
    digest = hashlib.blake2b(digest_size=16)
    view = memoryview(staged.buffer.numpy())  # type: ignore[arg-type]
    for i, spec in enumerate(staged.specs):
        if staged.stop.is_set():
            raise Abort(Cause.UPDATE_CANCELLED, "the staged set was discarded while it was digested")
        digest.update(f"{spec.name}|{spec.dtype}|{tuple(spec.shape)}".encode())
        digest.update(zlib.crc32(view[staged.offsets[i] : _end(staged, i)]).to_bytes(4, "little"))
    return digest.hexdigest()
