"""WeightUpdates: pause/resume, weight updates as long-running operations, fingerprints.

Runs in the `enginectl serve` process, on the control loop. The rules of DESIGN §5 live
here: validate everything before touching the model, one update at a time, pause with KEEP
(or the requested mode) when not paused and resume after, reset the prefix cache, record the
version only on success through the ledger's single writer, and on a failure after writing
began leave the version undeclared with `last_failure` and generation paused.

Workers (worker/weights.py) do the loading; this module reaches them through
`collective_rpc` on every EngineCore, and feeds them over per-update ZMQ channels
(tensor-stream chunks, and `abort` frames for CancelOperation, timeouts and broken streams).
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
import zmq
import zmq.asyncio
from google.protobuf import duration_pb2

from enginectl.client.types import WeightSource
from enginectl.server.disk import DTYPE_BYTES, TensorInfo, read_header, resolve_checkpoint
from enginectl.server.engine import EngineAdapter
from enginectl.server.errors import ControlPlaneError, FieldViolation, Reason, invalid_field, to_status
from enginectl.server.fingerprints import WeightFingerprints
from enginectl.server.ledger import Failure, Fingerprint, WeightVersionLedger
from enginectl.server.limits import (  # the bounds table (README "Limits")
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MAX_GROUP_TIMEOUT_S,
    MAX_GROUP_NAME_BYTES,
    MAX_GROUPS,
    MAX_SHAPE_RANK,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSOR_NAME_BYTES,
    MAX_TENSORS,
    MAX_TIMEOUT_S,
    MAX_VIOLATIONS,
    MAX_WORLD_SIZE,
    RPC_GRACE_S,
)
from enginectl.server.operations import OperationStore, UpdateOperation
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_pb2 as wv_pb2

log = structlog.get_logger("enginectl.updates")

PAUSE_MODES = {pb2.PAUSE_MODE_ABORT: "abort", pb2.PAUSE_MODE_WAIT: "wait", pb2.PAUSE_MODE_KEEP: "keep"}
DTYPE_NAMES = {
    pb2.TENSOR_DTYPE_FLOAT32: "float32", pb2.TENSOR_DTYPE_FLOAT16: "float16",
    pb2.TENSOR_DTYPE_BFLOAT16: "bfloat16", pb2.TENSOR_DTYPE_FLOAT64: "float64",
    pb2.TENSOR_DTYPE_INT8: "int8", pb2.TENSOR_DTYPE_INT16: "int16", pb2.TENSOR_DTYPE_INT32: "int32",
    pb2.TENSOR_DTYPE_INT64: "int64", pb2.TENSOR_DTYPE_UINT8: "uint8", pb2.TENSOR_DTYPE_BOOL: "bool",
    pb2.TENSOR_DTYPE_FLOAT8_E4M3FN: "float8_e4m3fn", pb2.TENSOR_DTYPE_FLOAT8_E5M2: "float8_e5m2",
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
SOURCE_PROTO = {
    WeightSource.DISK: wv_pb2.WEIGHT_SOURCE_DISK,
    WeightSource.DISTRIBUTED: wv_pb2.WEIGHT_SOURCE_DISTRIBUTED,
    WeightSource.TENSORS: wv_pb2.WEIGHT_SOURCE_TENSORS,
}
# Worker-side failure causes -> gRPC code of the operation's error.
CAUSE_CODES = {
    "UPDATE_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,
    "GROUP_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,
    "UPDATE_CANCELLED": grpc.StatusCode.CANCELLED,
    "STREAM_BROKEN": grpc.StatusCode.CANCELLED,
    "DATA_SIZE_MISMATCH": grpc.StatusCode.INVALID_ARGUMENT,
    "CHUNK_OUT_OF_ORDER": grpc.StatusCode.INVALID_ARGUMENT,
    "CHUNK_TOO_LARGE": grpc.StatusCode.INVALID_ARGUMENT,
    "HEADER_REQUIRED": grpc.StatusCode.INVALID_ARGUMENT,
    "GROUP_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "GROUP_BROKEN": grpc.StatusCode.FAILED_PRECONDITION,
    "ENGINE_DEAD": grpc.StatusCode.UNAVAILABLE,
    "ETAG_MISMATCH": grpc.StatusCode.ABORTED,
    "LOAD_FAILED": grpc.StatusCode.INTERNAL,
}


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _timeout(field: str, value: duration_pb2.Duration, present: bool, default: float = DEFAULT_TIMEOUT_S,
             maximum: float = MAX_TIMEOUT_S) -> float:
    if not present:
        return default
    # Not ToTimedelta(): a Duration beyond timedelta's range (seconds near 2**63) raised
    # OverflowError, which reached the caller as UNKNOWN.
    seconds = value.ToNanoseconds() / 1e9
    if seconds <= 0 or seconds > maximum:
        raise invalid_field(Reason.TIMEOUT_INVALID, field, f"must be in (0, {maximum:.0f}s]")
    return seconds


def _pause_mode(field: str, mode: int, *, default: str | None = "keep") -> str:
    if mode == pb2.PAUSE_MODE_UNSPECIFIED and default is not None:
        return default
    if mode not in PAUSE_MODES:
        raise invalid_field(Reason.PAUSE_MODE_INVALID, field, "must be ABORT, WAIT or KEEP")
    return PAUSE_MODES[mode]


@dataclass
class UpdatePlan:
    """A validated update, before anything was touched."""

    source: WeightSource
    tensors: list[TensorInfo]
    files: list[Path]
    group: str
    version: str | None
    etag: str
    request_id: str
    pause_mode: str
    reset_cache: bool
    timeout: float

    @property
    def bytes_total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def key(self) -> tuple[Any, ...]:
        """What makes two requests with one request_id the same request."""
        return (self.source, tuple(self.tensors), tuple(self.files), self.group, self.version,
                self.etag, self.pause_mode, self.reset_cache)


class _Channels:
    """One update's ZMQ channels: a PUSH per DP rank (data, aborts), one PULL (progress)."""

    def __init__(self, ctx: zmq.asyncio.Context, directory: Path, op_id: str, ranks: int) -> None:
        self.data_endpoints = [f"ipc://{directory}/{op_id}-data-{rank}.sock" for rank in range(ranks)]
        self.progress_endpoint = f"ipc://{directory}/{op_id}-progress.sock"
        self.data: list[zmq.asyncio.Socket] = []
        for endpoint in self.data_endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.bind(endpoint)
            self.data.append(sock)
        self.progress = ctx.socket(zmq.PULL)
        self.progress.setsockopt(zmq.LINGER, 0)
        self.progress.bind(self.progress_endpoint)
        self.aborted: tuple[str, str] | None = None

    async def send_chunk(self, offset: int, data: bytes) -> None:
        frames = [b"chunk", struct.pack("<Q", offset), data]
        await asyncio.gather(*(sock.send_multipart(frames, copy=False) for sock in self.data))

    def abort(self, cause: str, message: str) -> None:
        """Tell every rank to stop; never blocks (delivery is retried in the background)."""
        if self.aborted is None:
            self.aborted = (cause, message)
        frames = [b"abort", cause.encode(), message.encode()]
        for sock in self.data:
            asyncio.ensure_future(self._send_abort(sock, frames))

    @staticmethod
    async def _send_abort(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Deliver an abort frame, retrying while the rank has not connected yet (a PUSH with
        no peer refuses at once) or its queue is full; ends when the channel closes."""
        while not sock.closed:
            try:
                await sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await asyncio.sleep(0.01)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        for sock in (*self.data, self.progress):
            sock.close(0)


class WeightUpdates:
    """Generation pause state, weight updates and fingerprints of one engine."""

    def __init__(
        self,
        engine: EngineAdapter,
        ledger: WeightVersionLedger,
        store: OperationStore,
        *,
        allowed_roots: list[Path],
        expected: dict[str, TensorInfo],
        on_finished: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._store = store
        self.allowed_roots = allowed_roots
        self._expected = expected
        self._on_finished = on_finished  # (source, "ok" | "failed" | "partial", bytes loaded)
        self._served_dtype = engine.info.dtype
        self._ranks = engine.info.data_parallel_size
        self._ctx = zmq.asyncio.Context()
        self._dir = Path(tempfile.mkdtemp(prefix="enginectl-updates-"))
        # Generation state as this server knows it.
        self._caller_paused = False
        self._pause_mode = ""
        self._pause_time: float | None = None
        self._partial = False  # held paused after a partial update
        self._active: UpdateOperation | None = None
        self._plans: dict[str, tuple[tuple[Any, ...], UpdateOperation]] = {}
        self._groups: dict[str, pb2.WeightsUpdateGroup] = {}
        self._groups_pending: set[str] = set()
        self._groups_in_use: set[str] = set()
        self.fingerprints = WeightFingerprints(engine)
        self._utilities = False  # EngineCores have enginectl's utilities (see prepare)
        self._ranks_at_update_start: list[dict[str, Any]] = [
            {"dp_rank": r, "paused": False, "running": 0, "waiting": 0} for r in range(self._ranks)]

    @property
    def operations(self) -> OperationStore:
        return self._store

    def close(self) -> None:
        if self._active is not None:
            self._active.cancel()
        self._ctx.destroy(0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- generation ------------------------------------------------------------------

    async def _ranks_state(self) -> list[dict[str, Any]]:
        if self._utilities:
            return list(await self._engine.call_all("enginectl_generation_state"))
        # EngineCores without enginectl's utilities (the user's scheduler): less detail.
        paused = await self._engine.call_all("is_scheduler_paused")
        return [{"dp_rank": i, "paused": p, "running": 0, "waiting": 0} for i, p in enumerate(paused)]

    def _updating(self) -> bool:
        return self._active is not None and not self._active.done

    async def generation_state(self, known: list[dict[str, Any]] | None = None) -> pb2.GenerationState:
        """The state as GetGenerationState reports it; `known`: per-rank states the caller
        already has (saves a round trip to every EngineCore)."""
        if self._updating():
            # The EngineCores are busy loading (they answer no utility until done): report
            # what the update started from, paused.
            ranks = [dict(r, paused=True) for r in self._ranks_at_update_start]
        else:
            ranks = known if known is not None else await self._ranks_state()
        state = pb2.GenerationState(
            paused=any(r["paused"] for r in ranks),
            num_running_requests=sum(r["running"] for r in ranks),
            num_waiting_requests=sum(r["waiting"] for r in ranks),
            ranks=[pb2.RankGenerationState(dp_rank=r["dp_rank"], paused=r["paused"],
                                           num_running_requests=r["running"],
                                           num_waiting_requests=r["waiting"]) for r in ranks],
        )
        if state.paused:
            if self._updating() and not self._caller_paused:
                state.reason = pb2.PAUSE_REASON_UPDATE
            elif self._partial:
                state.reason = pb2.PAUSE_REASON_PARTIAL_UPDATE
            elif self._caller_paused:
                state.reason = pb2.PAUSE_REASON_CALLER
            else:
                state.reason = pb2.PAUSE_REASON_EXTERNAL
            if self._pause_mode:
                state.mode = {v: k for k, v in PAUSE_MODES.items()}[self._pause_mode]
            if self._pause_time is not None:
                state.pause_time.FromNanoseconds(int(self._pause_time * 1e9))
        if self._updating():
            assert self._active is not None
            state.update_operation = self._active.name
        return state

    async def _pause_engine(self, mode: str, clear_cache: bool, timeout: float | None) -> None:
        call = self._engine.call_all("pause_scheduler", mode, clear_cache)
        if timeout is None:
            await call
        else:
            await asyncio.wait_for(call, timeout)
        if self._pause_time is None:
            self._pause_time = time.time()
        self._pause_mode = mode

    async def _resume_engine(self) -> None:
        await self._engine.call_all("resume_scheduler")
        self._pause_time = None
        self._pause_mode = ""

    async def pause(self, request: pb2.PauseGenerationRequest) -> pb2.PauseGenerationResponse:
        mode = _pause_mode("mode", request.mode)  # unset: KEEP, as the proto says
        wait_timeout = _timeout("wait_timeout", request.wait_timeout, request.HasField("wait_timeout"),
                                default=MAX_TIMEOUT_S)
        if self._updating():
            if mode != "keep":
                raise self._in_progress(f"{mode.upper()} needs the engine, which is loading weights; "
                                        "KEEP marks generation to stay paused after the update")
            self._caller_paused = True
            state = await self.generation_state()
            return pb2.PauseGenerationResponse(state=state, was_paused=True)
        before = await self._ranks_state()
        was_paused = any(r["paused"] for r in before)
        started = time.monotonic()
        try:
            await self._pause_engine(mode, request.clear_cache, wait_timeout if mode == "wait" else None)
        except asyncio.TimeoutError:
            if not was_paused:
                await self._resume_engine()
            raise ControlPlaneError(
                grpc.StatusCode.DEADLINE_EXCEEDED, Reason.PAUSE_TIMEOUT,
                f"requests did not drain within {wait_timeout:.3f}s; generation was resumed"
                if not was_paused else f"requests did not drain within {wait_timeout:.3f}s",
            ) from None
        self._caller_paused = True
        in_flight = sum(r["running"] + r["waiting"] for r in before)
        # Right after the pause: KEEP holds the requests where they were, ABORT ended them (no
        # round trip needed); WAIT took long enough for new arrivals to queue, so ask.
        after = None if mode == "wait" else [
            dict(r, paused=True) if mode == "keep" else dict(r, paused=True, running=0, waiting=0) for r in before]
        return pb2.PauseGenerationResponse(
            state=await self.generation_state(after),
            was_paused=was_paused,
            num_aborted_requests=in_flight if mode == "abort" else 0,
            num_paused_requests=in_flight if mode == "keep" else 0,
            pause_duration=_duration(time.monotonic() - started),
        )

    async def resume(self, request: pb2.ResumeGenerationRequest) -> pb2.ResumeGenerationResponse:
        if self._active is not None and not self._active.done:
            if self._caller_paused:
                self._caller_paused = False  # the update resumes when it ends
                return pb2.ResumeGenerationResponse(state=await self.generation_state(), was_paused=True)
            raise self._in_progress("generation resumes when the update ends")
        if self._partial and not request.force:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION, Reason.PARTIAL_UPDATE,
                "the last update failed part-way and the weights may be mixed: load weights again, "
                "or resume with force=true to generate with them anyway",
            )
        ranks = await self._ranks_state()
        was_paused = any(r["paused"] for r in ranks)
        await self._resume_engine()
        self._caller_paused = False
        self._partial = False
        after = [dict(r, paused=False) for r in ranks]
        return pb2.ResumeGenerationResponse(state=await self.generation_state(after), was_paused=was_paused)

    def _in_progress(self, why: str) -> ControlPlaneError:
        assert self._active is not None
        return ControlPlaneError(grpc.StatusCode.ABORTED, Reason.UPDATE_IN_PROGRESS,
                                 f"{self._active.name} is running; {why}",
                                 metadata={"operation": self._active.name})

    def abort(self, op: UpdateOperation, cause: str, message: str) -> None:
        """Stop a running update (its workers see an abort frame)."""
        if not op.done and op.on_abort is not None:
            op.on_abort(cause, message)

    # --- fingerprints ----------------------------------------------------------------

    @property
    def fingerprint_method(self) -> str:
        return self.fingerprints.sampled_method

    @property
    def full_fingerprint_method(self) -> str:
        return self.fingerprints.full_method

    async def prepare(self) -> None:
        """Once, before serving: learn whether every EngineCore has enginectl's utilities (it
        does unless the user's own scheduler replaced enginectl's on a multi-worker engine)
        and, from one sampled fingerprint (milliseconds), the methods GetServerInfo reports."""
        try:
            await self._engine.call_all("enginectl_generation_state")
            self._utilities = True
        except ControlPlaneError:
            if self._engine.errored:
                raise
        await self.fingerprints.sampled()

    async def declaration_fingerprint(self) -> Fingerprint:
        """Recorded at every declaration (see server/fingerprints.py)."""
        return await self.fingerprints.declaration()

    async def verify(self, full: bool) -> tuple[int, Fingerprint | None, Fingerprint]:
        """(verdict, recorded, current) for VerifyWeights."""
        state = self._ledger.state
        recorded = state.fingerprint
        if full:
            recorded_full, current = await self.fingerprints.verify_full()
            if recorded is not None:
                recorded = recorded_full  # None: no full baseline (e.g. the weights changed since)
        else:
            current = await self.fingerprints.sampled()
        if not state.declared or recorded is None:
            return 3, recorded, current  # VERIFY_VERDICT_UNDECLARED
        return (1 if recorded.digest == current.digest else 2), recorded, current

    # --- validation ------------------------------------------------------------------

    def _check_common(self, *, version: str | None, etag: str, request_id: str) -> None:
        self._ledger.check_write(version=version, etag=etag, request_id=request_id)

    def check_tensors(self, tensors: list[TensorInfo], field: str = "tensors") -> None:
        """TENSOR_MISMATCH unless every tensor is one the model takes, in a dtype it can load."""
        if len(tensors) > MAX_TENSORS:
            raise invalid_field(Reason.TOO_MANY_TENSORS, field, f"{len(tensors)} tensors; at most {MAX_TENSORS}")
        if not tensors:
            raise invalid_field(Reason.TENSOR_SPEC_INVALID, field, "no tensor to load")
        violations: list[FieldViolation] = []
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            problem = ""
            want = self._expected.get(t.name)
            if t.name in seen:
                problem = f"duplicate tensor {t.name!r}"
            elif self._expected and want is None:
                problem = f"unknown tensor {t.name!r}: the model has no such weight"
            elif want is not None and t.shape != want.shape:
                problem = f"{t.name}: shape {list(t.shape)} but the model takes {list(want.shape)}"
            elif want is not None and t.dtype not in {want.dtype, self._served_dtype} and not (
                t.dtype in FLOAT_DTYPES and want.dtype in FLOAT_DTYPES
            ):
                problem = f"{t.name}: dtype {t.dtype} but the model takes {want.dtype}"
            seen.add(t.name)
            if problem:
                violations.append(FieldViolation(f"{field}[{i}]", problem))
        if violations:
            raise ControlPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT, Reason.TENSOR_MISMATCH,
                f"{len(violations)} tensor(s) the model can not take; first: {violations[0].description}",
                field_violations=violations[:MAX_VIOLATIONS],
            )

    def specs_from_proto(self, specs: Any, field: str = "tensors") -> list[TensorInfo]:
        if len(specs) > MAX_TENSORS:
            raise invalid_field(Reason.TOO_MANY_TENSORS, field, f"{len(specs)} tensors; at most {MAX_TENSORS}")
        tensors = []
        for i, spec in enumerate(specs):
            name_bytes = len(spec.name.encode())
            if not spec.name or name_bytes > MAX_TENSOR_NAME_BYTES:
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].name",
                                    f"required, at most {MAX_TENSOR_NAME_BYTES} bytes")
            if spec.dtype not in DTYPE_NAMES:
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].dtype", "a known TensorDtype")
            if len(spec.shape) > MAX_SHAPE_RANK or any(d < 0 for d in spec.shape):
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].shape",
                                    f"at most {MAX_SHAPE_RANK} non-negative dimensions")
            info = TensorInfo(spec.name, DTYPE_NAMES[spec.dtype], tuple(int(d) for d in spec.shape))
            if info.nbytes // DTYPE_BYTES[info.dtype] > MAX_TENSOR_ELEMENTS:
                raise invalid_field(Reason.TENSOR_SPEC_INVALID, f"{field}[{i}].shape", "too many elements")
            tensors.append(info)
        return tensors

    def plan_disk(self, request: pb2.UpdateWeightsFromDiskRequest) -> UpdatePlan:
        version = request.weight_version if request.HasField("weight_version") else None
        self._check_common(version=version, etag=request.etag, request_id=request.request_id)
        mode = _pause_mode("pause_mode", request.pause_mode)
        timeout = _timeout("timeout", request.timeout, request.HasField("timeout"))
        files = resolve_checkpoint(request.path, self.allowed_roots)
        tensors = [info for file in files for info in read_header(file)]
        self.check_tensors(tensors)
        return UpdatePlan(WeightSource.DISK, tensors, files, "", version, request.etag, request.request_id,
                          mode, request.reset_prefix_cache if request.HasField("reset_prefix_cache") else True,
                          timeout)

    def plan_distributed(self, request: pb2.UpdateWeightsFromDistributedRequest) -> UpdatePlan:
        version = request.weight_version if request.HasField("weight_version") else None
        self._check_common(version=version, etag=request.etag, request_id=request.request_id)
        self._check_group_name(request.group_name)
        mode = _pause_mode("pause_mode", request.pause_mode)
        timeout = _timeout("timeout", request.timeout, request.HasField("timeout"))
        tensors = self.specs_from_proto(request.tensors)
        self.check_tensors(tensors)
        if request.group_name not in self._groups:
            raise ControlPlaneError(grpc.StatusCode.NOT_FOUND, Reason.GROUP_NOT_FOUND,
                                    f"no update group {request.group_name!r}; create it with InitWeightsUpdateGroup")
        return UpdatePlan(WeightSource.DISTRIBUTED, tensors, [], request.group_name, version, request.etag,
                          request.request_id, mode,
                          request.reset_prefix_cache if request.HasField("reset_prefix_cache") else True, timeout)

    def plan_tensors(self, header: pb2.TensorStreamHeader) -> UpdatePlan:
        version = header.weight_version if header.HasField("weight_version") else None
        self._check_common(version=version, etag=header.etag, request_id=header.request_id)
        mode = _pause_mode("header.pause_mode", header.pause_mode)
        timeout = _timeout("header.timeout", header.timeout, header.HasField("timeout"))
        tensors = self.specs_from_proto(header.tensors, "header.tensors")
        self.check_tensors(tensors, "header.tensors")
        return UpdatePlan(WeightSource.TENSORS, tensors, [], "", version, header.etag, header.request_id,
                          mode, header.reset_prefix_cache if header.HasField("reset_prefix_cache") else True,
                          timeout)

    # --- running an update -----------------------------------------------------------

    async def start(self, plan: UpdatePlan,
                    feed: Callable[[_Channels, UpdateOperation], Awaitable[None]] | None = None,
                    ) -> tuple[UpdateOperation, bool]:
        """Create the Operation and start the update; (operation, started). A retried
        request_id returns the first operation (started=False).

        The ledger's write lock is taken here, before the Operation is returned, and held
        until the update is recorded: a declaration accepted after this call applies after
        the update, whatever it waits for (pausing included)."""
        if plan.request_id:
            known = self._plans.get(plan.request_id)
            if known is not None:
                if known[0] != plan.key():
                    raise invalid_field(Reason.REQUEST_ID_REUSED, "request_id", "already used by a different update")
                return known[1], False
        if self._active is not None and not self._active.done:
            raise self._in_progress("one update runs at a time")
        if plan.group:
            self._groups_in_use.add(plan.group)
        op_id = plan.request_id or str(uuid.uuid4())
        metadata = pb2.UpdateWeightsMetadata(
            phase=pb2.UPDATE_PHASE_VALIDATING, source=SOURCE_PROTO[plan.source], request_id=plan.request_id,
            tensors_total=len(plan.tensors), bytes_total=plan.bytes_total,
            ranks=[pb2.RankUpdateProgress(dp_rank=r, phase=pb2.UPDATE_PHASE_VALIDATING) for r in range(self._ranks)],
        )
        if plan.version is not None:
            metadata.weight_version = plan.version
        metadata.start_time.FromNanoseconds(time.time_ns())
        op = UpdateOperation(f"operations/{op_id}", metadata)
        op.touch()
        self._store.add(op)
        if plan.request_id:
            self._plans[plan.request_id] = (plan.key(), op)
        # A retry is answered while its Operation is still kept: forget the evicted ones.
        self._plans = {rid: known for rid, known in self._plans.items() if self._store.find(known[1].name) is known[1]}
        self._active = op  # from here on, another update is refused
        lock = self._ledger.writing()
        try:
            await lock.acquire()
        except asyncio.CancelledError:  # the caller went away before the update could start
            self._active = None
            cancelled = ControlPlaneError(grpc.StatusCode.CANCELLED, Reason.UPDATE_CANCELLED,
                                          "the call was cancelled before the update started")
            op.failure = cancelled
            op.finish(error=to_status(cancelled))
            raise
        log.info("weight update started", operation=op.name, request_id=plan.request_id,
                 source=plan.source.value, version=plan.version, tensors=len(plan.tensors))
        asyncio.ensure_future(self._run(op, op_id, plan, feed, lock))
        return op, True

    def _phase(self, op: UpdateOperation, phase: int) -> None:
        op.metadata.phase = phase
        for rank in op.metadata.ranks:
            rank.phase = phase
        op.touch()

    async def _run(self, op: UpdateOperation, op_id: str, plan: UpdatePlan,
                   feed: Callable[[_Channels, UpdateOperation], Awaitable[None]] | None,
                   lock: asyncio.Lock) -> None:
        started = time.monotonic()
        deadline = time.time() + plan.timeout
        channels = _Channels(self._ctx, self._dir, op_id[:36], self._ranks)
        op.on_abort = channels.abort
        paused_by_update = False
        holding = True  # the ledger's write lock, taken in start()
        pause_started = time.monotonic()
        pause_duration = 0.0
        in_flight = 0
        try:
            # The declaration this update may fail back to keeps its full baseline (taken in
            # slices between generation steps): let it finish before any weight changes.
            await self.fingerprints.settle()
            before = await self._ranks_state()
            self._ranks_at_update_start = before
            in_flight = sum(r["running"] + r["waiting"] for r in before)
            if not any(r["paused"] for r in before):
                self._phase(op, pb2.UPDATE_PHASE_PAUSING)
                try:
                    await self._pause_engine(plan.pause_mode, False,
                                             None if plan.pause_mode != "wait" else max(deadline - time.time(), 0.0))
                except asyncio.TimeoutError:
                    await self._resume_engine()  # WAIT stopped admitting requests: undo it
                    raise _UpdateFailed("UPDATE_TIMEOUT", "requests did not drain (pause_mode WAIT) within the "
                                        f"update's timeout ({plan.timeout:.3f}s); generation was resumed",
                                        modified=False) from None
                paused_by_update = True
                op.metadata.paused_by_update = True
            elif self._partial and not self._caller_paused:
                # Held paused by an earlier partial update: a success here resumes (rule 6).
                paused_by_update = True
                op.metadata.paused_by_update = True
            pause_duration = time.monotonic() - pause_started
            if op.cancel_requested.is_set():
                raise _UpdateFailed("UPDATE_CANCELLED", "CancelOperation before loading began", modified=False)
            try:
                self._ledger.check_etag(plan.etag)
            except ControlPlaneError as exc:
                raise _UpdateFailed("ETAG_MISMATCH", exc.message, modified=False, metadata=exc.metadata) from None
            self._phase(op, pb2.UPDATE_PHASE_RECEIVING if feed or plan.group else pb2.UPDATE_PHASE_LOADING)
            results = await self._load(op, plan, channels, deadline, feed)
            errors = [r["error"] for r in results if r["error"]]
            modified = any(r["weights_modified"] for r in results)
            if channels.aborted and not errors:
                errors = [list(channels.aborted)]
            if errors:
                cause, message = errors[0]
                raise _UpdateFailed(cause, message, modified=modified)
            op.metadata.weights_modified = modified
            resumed = paused_by_update and not self._caller_paused
            self._phase(op, pb2.UPDATE_PHASE_FINGERPRINTING)
            if self._utilities:
                # Cache reset, fingerprint, version stamp and resume: one round trip per rank.
                token = uuid.uuid4().hex if plan.version is not None else ""
                finished = await self._engine.call_all(
                    "enginectl_finish_update", plan.reset_cache, token, plan.version, resumed)
                fingerprint = None
                if token:
                    fingerprint = self.fingerprints.declared(token, [f["fingerprints"] for f in finished])
                state = await self._ledger.record_update(plan.version, plan.source, fingerprint, published=True)
            else:
                if plan.reset_cache:
                    await self._engine.call_all("reset_prefix_cache", True, False)  # see enginectl_finish_update
                fingerprint = await self.declaration_fingerprint() if plan.version is not None else None
                state = await self._ledger.record_update(plan.version, plan.source, fingerprint)
            lock.release()
            holding = False
            self._partial = False
            if resumed:
                self._pause_time, self._pause_mode = None, ""
                if not self._utilities:
                    await self._resume_engine()
                if self._caller_paused:  # PauseGeneration(KEEP) arrived while we finished
                    await self._pause_engine("keep", False, None)
                    resumed = False
            self._phase(op, pb2.UPDATE_PHASE_DONE)
            from enginectl.server.weight_version_service import weight_version_proto

            op.finish(response=pb2.UpdateWeightsResponse(
                weight_version=weight_version_proto(state),
                ranks=[pb2.RankUpdateResult(dp_rank=r["dp_rank"], tensors_loaded=r["tensors_loaded"],
                                            bytes_loaded=r["bytes_loaded"], duration=_duration(r["duration"]))
                       for r in _per_rank(results)],
                num_paused_requests=in_flight if paused_by_update and plan.pause_mode == "keep" else 0,
                num_aborted_requests=in_flight if paused_by_update and plan.pause_mode == "abort" else 0,
                prefix_cache_reset=plan.reset_cache,
                generation_resumed=resumed,
                pause_duration=_duration(pause_duration),
                duration=_duration(time.monotonic() - started),
            ))
            if self._on_finished is not None:
                self._on_finished(plan.source.value.lower(), "ok", sum(r["bytes_loaded"] for r in results))
            log.info("weights updated", operation=op.name, source=plan.source.value, version=plan.version,
                     tensors=len(plan.tensors), bytes=plan.bytes_total, seconds=round(time.monotonic() - started, 3))
        except _UpdateFailed as failure:
            await self._fail(op, plan, failure, paused_by_update)
        except ControlPlaneError as exc:
            await self._fail(op, plan, _UpdateFailed(exc.reason, exc.message, modified=op.metadata.weights_modified),
                             paused_by_update)
        except Exception as exc:  # noqa: BLE001 - an operation must always end
            log.exception("update failed unexpectedly", operation=op.name)
            await self._fail(op, plan, _UpdateFailed("LOAD_FAILED", f"{type(exc).__name__}: {exc}",
                                                     modified=op.metadata.weights_modified), paused_by_update)
        finally:
            if holding:
                lock.release()
            channels.close()
            self._groups_in_use.discard(plan.group)
            if self._active is op:
                self._active = None

    async def _fail(self, op: UpdateOperation, plan: UpdatePlan, failure: _UpdateFailed, paused_by_update: bool) -> None:
        code = CAUSE_CODES.get(failure.cause, grpc.StatusCode.INTERNAL)
        self._phase(op, pb2.UPDATE_PHASE_FAILED)
        op.metadata.weights_modified = failure.modified
        if failure.modified:
            self._partial = True
            self._ledger.record_failure(Failure(  # the write lock is still held (see _run)
                reason=Reason.PARTIAL_UPDATE, cause=failure.cause, message=failure.message, time=time.time(),
                attempted_version=plan.version or "", operation=op.name,
            ))
            if not paused_by_update:
                # Generation was running under someone else's pause (e.g. vLLM's own API):
                # hold it paused all the same; the weights may be mixed.
                await self._pause_engine("keep", False, None)
            error = ControlPlaneError(
                code, Reason.PARTIAL_UPDATE,
                f"the update failed after writing began ({failure.cause}: {failure.message}); the weights may "
                "be mixed: the version is undeclared and generation stays paused until an update succeeds "
                "or ResumeGeneration(force=true)",
                metadata={"cause": failure.cause, "operation": op.name},
            )
        else:
            if paused_by_update and not self._caller_paused and not self._partial:
                try:
                    await self._resume_engine()
                except ControlPlaneError:
                    log.exception("resume after a failed update failed", operation=op.name)
            error = ControlPlaneError(code, failure.cause, failure.message,
                                      metadata=dict(failure.metadata, operation=op.name))
        if plan.group and failure.cause in ("GROUP_TIMEOUT", "STREAM_BROKEN", "UPDATE_CANCELLED", "GROUP_BROKEN"):
            await self._drop_group(plan.group)
        op.failure = error
        op.finish(error=to_status(error))
        if self._on_finished is not None:
            self._on_finished(plan.source.value.lower(), "partial" if failure.modified else "failed", 0)
        log.warning("weight update failed", operation=op.name, cause=failure.cause, partial=failure.modified,
                    message=failure.message)

    async def _load(self, op: UpdateOperation, plan: UpdatePlan, channels: _Channels, deadline: float,
                    feed: Callable[[_Channels, UpdateOperation], Awaitable[None]] | None) -> list[dict[str, Any]]:
        worker_plan = {
            "source": {WeightSource.DISK: "disk", WeightSource.TENSORS: "tensors",
                       WeightSource.DISTRIBUTED: "distributed"}[plan.source],
            "files": [str(f) for f in plan.files],
            "tensors": [[t.name, t.dtype, list(t.shape)] for t in plan.tensors],
            "group": plan.group,
            "data_endpoints": channels.data_endpoints,
            "progress_endpoint": channels.progress_endpoint,
            "deadline": deadline,
        }
        load = asyncio.ensure_future(self._engine.call_all(
            "collective_rpc", "enginectl_load", plan.timeout + RPC_GRACE_S, (worker_plan,), None))
        progress = asyncio.ensure_future(self._progress(op, channels))
        timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + max(deadline - time.time(), 0.0),
            lambda: channels.abort("UPDATE_TIMEOUT", f"the update's timeout ({plan.timeout:.3f}s) elapsed"),
        )
        feeding = asyncio.ensure_future(feed(channels, op)) if feed is not None else None
        try:
            per_rank = await load
            if feeding is not None:
                await asyncio.wait({feeding}, timeout=1.0)
            return [worker for workers in per_rank for worker in workers]
        finally:
            timer.cancel()
            if feeding is not None and not feeding.done():
                feeding.cancel()
            progress.cancel()

    async def _progress(self, op: UpdateOperation, channels: _Channels) -> None:
        """Fold the workers' progress reports into the operation's metadata."""
        done: dict[int, tuple[int, int]] = {}
        while True:
            frame = await channels.progress.recv()
            rank, tensors, nbytes = struct.unpack("<iIQ", frame)
            done[rank] = (tensors, nbytes)
            for progress in op.metadata.ranks:
                if progress.dp_rank == rank:
                    progress.tensors_done, progress.bytes_done = tensors, nbytes
                    progress.phase = pb2.UPDATE_PHASE_LOADING
            op.metadata.tensors_done = min(t for t, _ in done.values()) if len(done) == self._ranks else 0
            op.metadata.bytes_done = min(b for _, b in done.values()) if len(done) == self._ranks else 0
            if op.metadata.tensors_done:
                op.metadata.phase = pb2.UPDATE_PHASE_LOADING
                op.metadata.weights_modified = True
            op.touch()

    # --- groups ------------------------------------------------------------------------

    def _check_group_name(self, name: str, field: str = "group_name") -> None:
        if not name or len(name.encode()) > MAX_GROUP_NAME_BYTES or not all(c.isalnum() or c in "-_." for c in name):
            raise invalid_field(Reason.GROUP_NAME_INVALID, field,
                                f"1-{MAX_GROUP_NAME_BYTES} bytes of letters, digits, '-', '_' or '.'")

    async def init_group(self, request: pb2.InitWeightsUpdateGroupRequest) -> pb2.WeightsUpdateGroup:
        self._check_group_name(request.group_name)
        if not request.master_address or len(request.master_address.encode()) > 253:
            raise invalid_field(Reason.MASTER_ADDRESS_INVALID, "master_address", "a host name or address, at most 253 bytes")
        if not 0 < request.master_port < 65536:
            raise invalid_field(Reason.MASTER_ADDRESS_INVALID, "master_port", "in 1..65535")
        workers = self._engine.info.num_workers
        if request.world_size > MAX_WORLD_SIZE:
            raise invalid_field(Reason.GROUP_SIZE_INVALID, "world_size", f"at most {MAX_WORLD_SIZE}")
        if request.rank_offset < 1 or request.world_size < request.rank_offset + workers:
            raise invalid_field(Reason.GROUP_SIZE_INVALID, "world_size",
                                f"rank_offset must be >= 1 (the trainer is rank 0) and world_size >= "
                                f"rank_offset + {workers} (this engine's workers)")
        if request.backend == pb2.GROUP_BACKEND_UNSPECIFIED:
            raise invalid_field(Reason.GROUP_BACKEND_REQUIRED, "backend", "GLOO or NCCL")
        if request.backend not in (pb2.GROUP_BACKEND_GLOO, pb2.GROUP_BACKEND_NCCL):
            raise invalid_field(Reason.GROUP_BACKEND_REQUIRED, "backend", "GLOO or NCCL")
        timeout = _timeout("timeout", request.timeout, request.HasField("timeout"), default=DEFAULT_GROUP_TIMEOUT_S,
                           maximum=MAX_GROUP_TIMEOUT_S)
        if request.backend == pb2.GROUP_BACKEND_NCCL and pb2.UPDATE_BACKEND_NCCL not in self.backends():
            raise ControlPlaneError(grpc.StatusCode.FAILED_PRECONDITION, Reason.BACKEND_UNAVAILABLE,
                                    "NCCL needs CUDA GPUs; this engine has none (use GLOO or the tensor stream)")
        name = request.group_name
        if name in self._groups or name in self._groups_pending:
            raise ControlPlaneError(grpc.StatusCode.ALREADY_EXISTS, Reason.GROUP_EXISTS, f"group {name!r} exists")
        if len(self._groups) + len(self._groups_pending) >= MAX_GROUPS:
            raise ControlPlaneError(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.TOO_MANY_GROUPS,
                                    f"{MAX_GROUPS} groups exist; destroy one first")
        spec = {"name": name, "master_address": request.master_address, "master_port": request.master_port,
                "rank_offset": request.rank_offset, "world_size": request.world_size, "timeout": timeout,
                "backend": "nccl" if request.backend == pb2.GROUP_BACKEND_NCCL else "gloo"}
        self._groups_pending.add(name)
        try:
            outcomes = await self._engine.call_each("collective_rpc", "enginectl_init_group", timeout + 5,
                                                    (spec,), None, timeout=timeout + 10)
        finally:
            self._groups_pending.discard(name)
        failed = [o for o in outcomes if o.failure]
        if failed:
            await self._engine.call_each("collective_rpc", "enginectl_destroy_group", None, (name,), None, timeout=30)
            message = "; ".join(f"rank {o.dp_rank}: {o.message}" for o in failed)
            if "imeout" in message or any(o.failure == "RANK_TIMEOUT" for o in failed):
                raise ControlPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, Reason.GROUP_TIMEOUT,
                                        f"not every member joined group {name!r} within {timeout:.3f}s: {message}")
            raise ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.GROUP_INIT_FAILED,
                                    f"joining group {name!r} failed: {message}")
        group = pb2.WeightsUpdateGroup(
            group_name=name, backend=request.backend, master_address=request.master_address,
            master_port=request.master_port, world_size=request.world_size, rank_offset=request.rank_offset,
            num_engine_ranks=workers,
        )
        group.create_time.FromNanoseconds(time.time_ns())
        self._groups[name] = group
        log.info("update group created", group=name, backend=spec["backend"], world_size=request.world_size)
        return group

    async def destroy_group(self, request: pb2.DestroyWeightsUpdateGroupRequest) -> bool:
        self._check_group_name(request.group_name)
        name = request.group_name
        if name in self._groups_in_use:
            raise ControlPlaneError(grpc.StatusCode.FAILED_PRECONDITION, Reason.GROUP_IN_USE,
                                    f"an update is receiving through {name!r}; cancel it first")
        if name not in self._groups:
            if request.allow_missing:
                return False
            raise ControlPlaneError(grpc.StatusCode.NOT_FOUND, Reason.GROUP_NOT_FOUND, f"no update group {name!r}")
        await self._drop_group(name)
        return True

    async def _drop_group(self, name: str) -> None:
        self._groups.pop(name, None)
        await self._engine.call_each("collective_rpc", "enginectl_destroy_group", None, (name,), None, timeout=30)

    def backends(self) -> list[int]:
        backends = [pb2.UPDATE_BACKEND_DISK, pb2.UPDATE_BACKEND_GLOO, pb2.UPDATE_BACKEND_TENSOR_STREAM]
        try:
            import torch

            if torch.cuda.is_available() and torch.distributed.is_nccl_available():
                backends.insert(2, pb2.UPDATE_BACKEND_NCCL)
        except Exception:  # noqa: BLE001 - no torch CUDA: no NCCL
            pass
        return backends


class _UpdateFailed(Exception):
    def __init__(self, cause: str, message: str, *, modified: bool, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.cause, self.message, self.modified = cause, message, modified
        self.metadata = dict(metadata or {})


def _per_rank(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers' results folded per DP rank (TP workers of one rank added up)."""
    ranks: dict[int, dict[str, Any]] = {}
    for r in results:
        acc = ranks.setdefault(r["dp_rank"], {"dp_rank": r["dp_rank"], "tensors_loaded": 0, "bytes_loaded": 0,
                                              "duration": 0.0})
        acc["tensors_loaded"] = max(acc["tensors_loaded"], r["tensors_loaded"])
        acc["bytes_loaded"] += r["bytes_loaded"]
        acc["duration"] = max(acc["duration"], r["duration"])
    return [ranks[k] for k in sorted(ranks)]
