"""WeightUpdates: weight updates as long-running operations, and the weights' fingerprints.

Runs in the `enginectl serve` process, on the control loop. The rules
(docs/architecture.md, "The update state machine"): validate everything before touching the
model (plans.py), one update at a time, pause with the requested mode (KEEP by default) when
not paused and resume after, reset the prefix cache, record the version only on success
through the ledger's single writer, and on a failure after writing began leave the version
undeclared with `last_failure` and generation paused (generation.py).

Pausing for an update, finishing it and its two endings are in update_steps.py; stages in
staging.py. Workers (worker/weights/) do the loading; this module reaches them through the typed
EngineAdapter and feeds them over per-update ZMQ channels (channels.py).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog
import zmq.asyncio

from enginectl.contract.engine import Cause, LoadResult
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field, to_status
from enginectl.server.limits import RPC_GRACE_S
from enginectl.server.weights.channels import UpdateChannels
from enginectl.server.weights.convert import source_proto
from enginectl.server.weights.disk import TensorInfo
from enginectl.server.weights.engine_protocols import UpdateEngine
from enginectl.server.weights.fingerprints import WeightFingerprints
from enginectl.server.weights.generation import Generation
from enginectl.server.weights.groups import UpdateGroups, backends
from enginectl.server.weights.ledger import Fingerprint, WeightVersionLedger
from enginectl.server.weights.operations import OperationStore, UpdateOperation
from enginectl.server.weights.outcome import UpdateFailed, UpdatePause
from enginectl.server.weights.plans import UpdatePlan, UpdateValidator
from enginectl.server.weights.staging import DEFAULT_TTL_S, STAGED_PREFIX, Feed, StagedSet, Staging
from enginectl.server.weights.update_steps import UpdateSteps
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_service_pb2 as wvs_pb2

log = structlog.get_logger("enginectl.updates")


class WeightUpdates(UpdateSteps):
    """Generation pause state, weight updates and fingerprints of one engine."""

    def __init__(
        self,
        engine: UpdateEngine,
        ledger: WeightVersionLedger,
        store: OperationStore,
        *,
        allowed_roots: list[Path],
        expected: dict[str, TensorInfo],
        on_finished: Callable[[str, str, int, float], None] | None = None,
        on_pause: Callable[[str | None], None] | None = None,
        max_staged_bytes: int | None = None,
        staged_ttl: float = DEFAULT_TTL_S,
        on_staged_bytes: Callable[[int], None] | None = None,
        fingerprints: WeightFingerprints | None = None,
        on_partial: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._store = store
        # (source, result, bytes loaded, seconds) of every update that ends; result: "ok",
        # "failed", "partial" (failed after writing began) or "cancelled" (before it began).
        self._on_finished = on_finished
        self._ranks = engine.info.data_parallel_size
        self._ctx = zmq.asyncio.Context()
        self._dir = Path(tempfile.mkdtemp(prefix="enginectl-updates-"))
        self.generation = Generation(engine, self._ranks, on_pause, on_partial)
        self.groups = UpdateGroups(engine)
        self.plans = UpdateValidator(
            ledger, self.groups, allowed_roots=allowed_roots, expected=expected, served_dtype=engine.info.dtype
        )
        # Built by the caller when the ledger's declarations need it before this object exists.
        self.fingerprints = fingerprints if fingerprints is not None else WeightFingerprints(engine)
        model_bytes = sum(t.nbytes for t in expected.values())
        self.staging = Staging(
            engine,
            ledger,
            self._ctx,
            self._dir,
            self._ranks,
            max_bytes=max_staged_bytes if max_staged_bytes is not None else model_bytes,
            ttl=staged_ttl,
            on_bytes=on_staged_bytes,
        )
        self._plans: dict[str, tuple[tuple[object, ...], UpdateOperation]] = {}  # by request_id

    @property
    def operations(self) -> OperationStore:
        return self._store

    @property
    def allowed_roots(self) -> list[Path]:
        return self.plans.allowed_roots

    def close(self) -> None:
        if self.generation.active is not None:
            self.generation.active.cancel()
        self._ctx.destroy(0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- what the servicers call ---------------------------------------------------------

    async def pause(self, request: pb2.PauseGenerationRequest) -> pb2.PauseGenerationResponse:
        return await self.generation.pause(request)

    async def resume(self, request: pb2.ResumeGenerationRequest) -> pb2.ResumeGenerationResponse:
        return await self.generation.resume(request)

    async def generation_state(self) -> pb2.GenerationState:
        state = await self.generation.state()
        if self.staging.current is not None:
            state.staged.CopyFrom(self.staging.current.proto())
        return state

    async def init_group(self, request: pb2.InitWeightsUpdateGroupRequest) -> pb2.WeightsUpdateGroup:
        return await self.groups.init(request)

    async def destroy_group(self, request: pb2.DestroyWeightsUpdateGroupRequest) -> bool:
        return await self.groups.destroy(request)

    def backends(self) -> list[pb2.UpdateBackend.ValueType]:
        return backends()

    def plan_disk(self, request: pb2.UpdateWeightsFromDiskRequest) -> UpdatePlan:
        return self.plans.disk(request)

    def plan_distributed(self, request: pb2.UpdateWeightsFromDistributedRequest) -> UpdatePlan:
        return self.plans.distributed(request)

    def plan_tensors(self, header: pb2.TensorStreamHeader) -> UpdatePlan:
        return self.plans.tensors(header)

    def retried_commit(self, request: pb2.CommitStagedWeightsRequest) -> UpdateOperation | None:
        """A commit retried with its request_id: the first one's Operation (its set may be
        consumed by now); REQUEST_ID_REUSED when that key named another update."""
        known = self._plans.get(request.request_id) if request.request_id else None
        if known is None:
            return None
        if known[0][-1] != request.name.removeprefix(STAGED_PREFIX):  # the key ends with the stage token
            raise invalid_field(Reason.REQUEST_ID_REUSED, "request_id", "already used by a different update")
        return known[1]

    def plan_commit(self, request: pb2.CommitStagedWeightsRequest) -> UpdatePlan:
        staged = self.staging.find(request.name)
        return self.plans.commit(request, staged.plan, staged.token)

    async def discard(self, request: pb2.DiscardStagedWeightsRequest) -> pb2.DiscardStagedWeightsResponse:
        def cancel(name: str) -> None:
            op = self._store.find(name)
            if op is not None:
                op.cancel()

        found, freed = await self.staging.discard(request.name, request.allow_missing, cancel)
        return pb2.DiscardStagedWeightsResponse(found=found, bytes_freed=freed)

    def abort(self, op: UpdateOperation, cause: Cause, message: str) -> None:
        """Stop a running update (its workers see an abort frame)."""
        if not op.done and op.on_abort is not None:
            op.on_abort(cause, message)

    # --- fingerprints --------------------------------------------------------------------

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
            await self._engine.generation_state()
            self.generation.utilities = True
        except ControlPlaneError:
            if self._engine.errored:
                raise
        await self.fingerprints.sampled()

    async def verify(self, full: bool) -> tuple[wvs_pb2.VerifyVerdict.ValueType, Fingerprint | None, Fingerprint]:
        """(verdict, recorded, current) for VerifyWeights."""
        return await self.fingerprints.verify(self._ledger.state, full)

    # --- running an update -----------------------------------------------------------------

    async def start(self, plan: UpdatePlan, feed: Feed | None = None) -> tuple[UpdateOperation, bool]:
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
        if self.generation.updating():
            raise self.generation.in_progress("one update runs at a time")
        self.staging.check_idle()
        if plan.stage_token:
            self.staging.check_committable(plan.stage_token)
        if plan.stage_only:
            self.staging.check(plan)
        if plan.group:
            self.groups.in_use.add(plan.group)
        op_id = plan.request_id or str(uuid.uuid4())
        metadata = pb2.UpdateWeightsMetadata(
            phase=pb2.UPDATE_PHASE_VALIDATING,
            source=source_proto(plan.source),
            request_id=plan.request_id,
            tensors_total=len(plan.tensors),
            bytes_total=plan.bytes_total,
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
        if plan.stage_only:  # no pause, no ledger lock: generation and declarations go on
            staged = self.staging.reserve(plan, op)
            asyncio.ensure_future(self._stage(staged, op, plan, feed))
            return op, True
        self.generation.active = op  # from here on, another update is refused
        if plan.stage_token:  # from here on, a discard of the set is refused
            self.staging.commit_started(plan.stage_token, op.name)
        lock = self._ledger.writing()
        try:
            await lock.acquire()
        except asyncio.CancelledError:  # the caller went away before the update could start
            self.generation.active = None
            if plan.stage_token:
                self.staging.commit_ended(plan.stage_token, op.name)
            cancelled = ControlPlaneError(
                grpc.StatusCode.CANCELLED, Reason.UPDATE_CANCELLED, "the call was cancelled before the update started"
            )
            op.failure = cancelled
            op.finish(error=to_status(cancelled))
            self._report(op, plan, "cancelled", 0)
            raise
        log.info(
            "weight update started",
            operation=op.name,
            request_id=plan.request_id,
            source=plan.source.value,
            version=plan.version,
            tensors=len(plan.tensors),
        )
        asyncio.ensure_future(self._run(op, op_id, plan, feed, lock))
        return op, True

    async def _stage(self, staged: StagedSet, op: UpdateOperation, plan: UpdatePlan, feed: Feed | None) -> None:
        log.info("weight stage started", operation=op.name, source=plan.source.value, tensors=len(plan.tensors))
        try:
            await self.staging.run(staged, op, feed, time.monotonic())
        finally:
            self.groups.in_use.discard(plan.group)

    async def _run(
        self, op: UpdateOperation, op_id: str, plan: UpdatePlan, feed: Feed | None, lock: asyncio.Lock
    ) -> None:
        """The update, start to end; every way out finishes the Operation."""
        gen = self.generation
        started = time.monotonic()
        deadline = time.time() + plan.timeout
        channels = UpdateChannels(self._ctx, self._dir, op_id[:36], self._ranks)
        op.on_abort = channels.abort
        pause = UpdatePause()  # generation as the update found it, and what pausing did
        holding = True  # the ledger's write lock, taken in start()
        try:
            # The last declaration's full baseline may still be running in slices: it is not
            # waited for. Its slices queue behind this update's load on the engine; the worker
            # answers them "superseded" once the load wrote a weight (the version is then new,
            # or undeclared), and goes on hashing if the update failed before writing.
            pause = await self._pause_for(op, plan, deadline)
            marks = [("pause", time.monotonic())]
            if op.cancel_requested.is_set():
                raise UpdateFailed(Cause.UPDATE_CANCELLED, "CancelOperation before loading began", modified=False)
            try:
                self._ledger.check_etag(plan.etag)
            except ControlPlaneError as exc:
                raise UpdateFailed(Cause.ETAG_MISMATCH, exc.message, modified=False, metadata=exc.metadata) from None
            op.set_phase(pb2.UPDATE_PHASE_RECEIVING if feed or plan.group else pb2.UPDATE_PHASE_LOADING)
            results = await self._load(op, plan, channels, deadline, feed)
            marks.append(("load", time.monotonic()))
            errors = [(r.error.cause, r.error.message) for r in results if r.error is not None]
            modified = any(r.weights_modified for r in results)
            if channels.aborted and not errors:
                errors = [channels.aborted]
            if errors:
                cause, message = errors[0]
                raise UpdateFailed(cause, message, modified=modified)
            op.metadata.weights_modified = modified
            resumed = pause.resumes and not gen.caller_paused
            op.set_phase(pb2.UPDATE_PHASE_FINGERPRINTING)
            state = await self._finish(plan, resumed, marks)
            lock.release()
            holding = False
            await gen.set_partial(False)
            if resumed:
                gen.resumed()
                if not gen.utilities:
                    await gen.resume_engine()
                if gen.caller_paused:  # PauseGeneration(KEEP) arrived while we finished
                    await gen.pause_engine("keep", False, None)
                    resumed = False
            op.set_phase(pb2.UPDATE_PHASE_DONE)
            self._succeeded(op, plan, state, results, started, pause, resumed, marks)
            if plan.stage_token:  # the staged set is consumed (its buffer kept for the next)
                await self.staging.committed(plan.stage_token)
        except UpdateFailed as failure:
            await self._fail(op, plan, failure, pause.resumes)
        except ControlPlaneError as exc:
            await self._fail(
                op, plan, UpdateFailed(exc.reason, exc.message, modified=op.metadata.weights_modified), pause.resumes
            )
        except Exception as exc:  # an operation must always end; logged with its traceback
            log.exception("update failed unexpectedly", operation=op.name)
            await self._fail(
                op,
                plan,
                UpdateFailed(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}", modified=op.metadata.weights_modified),
                pause.resumes,
            )
        finally:
            if holding:
                lock.release()
            channels.close()
            self.groups.in_use.discard(plan.group)
            if plan.stage_token:
                self.staging.commit_ended(plan.stage_token, op.name)
            if gen.active is op:
                gen.active = None

    async def _load(
        self, op: UpdateOperation, plan: UpdatePlan, channels: UpdateChannels, deadline: float, feed: Feed | None
    ) -> list[LoadResult]:
        worker_plan = plan.worker_plan(channels, deadline)
        load = asyncio.ensure_future(self._engine.load(worker_plan, timeout=plan.timeout + RPC_GRACE_S))
        progress = asyncio.ensure_future(op.follow_progress(channels.next_progress))
        loop = asyncio.get_running_loop()
        timer = loop.call_at(
            loop.time() + max(deadline - time.time(), 0.0),
            lambda: channels.abort(Cause.UPDATE_TIMEOUT, f"the update's timeout ({plan.timeout:.3f}s) elapsed"),
        )
        feeding = asyncio.ensure_future(feed(channels, op)) if feed is not None else None
        try:
            try:
                results = await load
            except ControlPlaneError as exc:
                if exc.reason != Reason.WORKER_TIMEOUT:
                    raise
                # A worker was still loading when the call's timeout passed: whatever it wrote
                # is unknown, so the weights count as mixed (docs/architecture.md).
                raise UpdateFailed(Cause.WORKER_TIMEOUT, exc.message, modified=True) from None
            if feeding is not None:
                await asyncio.wait({feeding}, timeout=1.0)
            return results
        finally:
            timer.cancel()
            if feeding is not None and not feeding.done():
                feeding.cancel()
            progress.cancel()
