"""UpdateRun: one weight update, from its pause to its end, and the state only it holds.

Runs in the `enginectl serve` process, on the control loop, as one task per update
(WeightUpdates.start makes the run once the update holds the ledger's write lock and starts
it). A run holds its Operation, plan, source, pause and timing marks; the long-lived state
it works with (generation, fingerprints, staging, the ledger) is WeightUpdates', handed to it
as `RunParts`. How the weights arrive is the update's source (plans.py UpdateSource): the run
asks it to load, and finishes with what it answers; no step here asks which source it is.
Its steps follow docs/architecture.md, "The update state machine":
pause (unless paused already), load through the workers, then finish (cache reset, version
stamp, resume, fingerprint) and record the version, or fail (resume, or hold generation paused
and leave the version undeclared once writing began). How the engine is paused and an update
finished is the generation's pause path (pause_paths.py): no step here asks which it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from enginectl.contract.engine import UNDECLARED_LABEL, Cause, LoadCheck, LoadResult, PauseReason
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.weights.convert import load_results_proto
from enginectl.server.weights.engine_protocols import UpdateEngine
from enginectl.server.weights.update.generation import Generation
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.update.outcome import UpdateFailed, UpdatePause, report_finished, success_response
from enginectl.server.weights.update.plans import UpdatePlan, UpdateSource
from enginectl.server.weights.update.staging import Staging
from enginectl.server.weights.version.fingerprints import WeightFingerprints
from enginectl.server.weights.version.ledger import Failure, VersionState, WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.updates")


@dataclass(frozen=True)
class RunParts:
    """The long-lived state every update works with; WeightUpdates owns it."""

    engine: UpdateEngine
    ledger: WeightVersionLedger
    generation: Generation
    fingerprints: WeightFingerprints
    staging: Staging
    # (source, result, bytes loaded, seconds) of every update that ends (outcome.report_finished).
    on_finished: Callable[[str, str, int, float], None] | None


class UpdateRun:
    """One update (not stage_only), holding the ledger's write lock from its start."""

    def __init__(
        self, parts: RunParts, op: UpdateOperation, plan: UpdatePlan, source: UpdateSource, lock: asyncio.Lock
    ) -> None:
        self._parts = parts
        self._op = op
        self._plan = plan  # the version a transfer round's finish names replaces the plan's
        self._source = source  # how the weights arrive, chosen by WeightUpdates.start
        self._lock = lock  # taken by WeightUpdates.start, released once the update is recorded
        self._pause_state = UpdatePause()  # generation as the update found it, and what pausing did
        self._marks: list[tuple[str, float]] = []  # (step, when it ended): the success log's phases
        self._cache_reset = False  # the prefix cache was reset at the finish (set there)
        self._started = 0.0  # monotonic, and the deadline (wall clock): set when the run starts
        self._deadline = 0.0

    async def run(self) -> None:
        """The update, start to end; every way out finishes the Operation."""
        gen, op, plan, source = self._parts.generation, self._op, self._plan, self._source
        self._started = time.monotonic()
        self._deadline = time.time() + plan.timeout
        holding = True  # the ledger's write lock
        try:
            # The last declaration's full baseline may still be running in slices: it is not
            # waited for. Its slices queue behind this update's load on the engine; the worker
            # answers them "superseded" once the load wrote a weight (the version is then new,
            # or undeclared), and goes on hashing if the update failed before writing.
            self._pause_state = await self._pause_generation()
            self._marks.append(("pause", time.monotonic()))
            if op.cancel_requested.is_set():
                raise UpdateFailed(Cause.UPDATE_CANCELLED, "CancelOperation before loading began", modified=False)
            try:
                self._parts.ledger.check_etag(plan.etag)
            except ControlPlaneError as exc:
                raise UpdateFailed(Cause.ETAG_MISMATCH, exc.message, modified=False, metadata=exc.metadata) from None
            op.set_phase(pb2.UPDATE_PHASE_RECEIVING if source.receives else pb2.UPDATE_PHASE_LOADING)
            loaded = await source.load(op, plan, self._deadline)
            self._marks.append(("load", time.monotonic()))
            results = loaded.results
            op.record_results(load_results_proto(results))  # every worker's own account, ok or not
            errors = [(r.error.cause, r.error.message) for r in results if r.error is not None]
            modified = any(r.weights_modified for r in results)
            if loaded.aborted and not errors:
                errors = [loaded.aborted]
            if errors:
                cause, message = errors[0]
                raise UpdateFailed(cause, message, modified=modified)
            op.record_modified(modified)
            self._plan = plan = loaded.applied_to(plan)
            resumed = self._pause_state.resumes and not gen.caller_paused
            op.set_phase(pb2.UPDATE_PHASE_FINGERPRINTING)
            # An update after a partial one (the engine quarantined, generation maybe forced to
            # run over mixed weights) also zeroes the KV cache and always resets the prefix cache.
            recovering = gen.quarantined
            await self._check(recovering)
            self._marks.append(("check", time.monotonic()))
            self._cache_reset = plan.reset_cache or recovering
            state = await self._finish(resumed, reset_cache=self._cache_reset)
            self._lock.release()
            holding = False
            await gen.set_partial(False)
            if resumed:
                await gen.resume_after_update()
                if gen.caller_paused:  # PauseGeneration(KEEP) arrived while we finished
                    await gen.pause_engine("keep", False, None)
                    resumed = False
            op.set_phase(pb2.UPDATE_PHASE_DONE)
            self._succeeded(state, results, resumed)
            if plan.stage_token:  # the staged set is consumed (its buffer kept for the next)
                await self._parts.staging.committed(plan.stage_token)
        except UpdateFailed as failure:
            await self._fail(failure)
        except ControlPlaneError as exc:
            await self._fail(UpdateFailed(exc.reason, exc.message, modified=op.metadata.weights_modified))
        except Exception as exc:  # an operation must always end; logged with its traceback
            log.exception("update failed unexpectedly", operation=op.name)
            await self._fail(
                UpdateFailed(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}", modified=op.metadata.weights_modified)
            )
        finally:
            if holding:
                self._lock.release()
            source.close()
            if plan.stage_token:
                self._parts.staging.commit_ended(plan.stage_token, op.name)
            gen.update_ended(op)

    async def _pause_generation(self) -> UpdatePause:
        """Pause generation for the update unless it is paused already: (paused by the update,
        requests in flight at the start, seconds the pause took)."""
        gen, op, plan = self._parts.generation, self._op, self._plan
        pause_started = time.monotonic()
        paused_by_update = False
        if plan.pause_mode != "wait":  # the state read and the pause: one trip where the path can
            before, paused_by_update = await gen.pause_if_running(
                plan.pause_mode, lambda: op.set_phase(pb2.UPDATE_PHASE_PAUSING)
            )
        else:
            before = await gen.ranks()
        gen.update_started_from(before)
        in_flight = sum(r.running + r.waiting for r in before)
        if not paused_by_update and not any(r.paused for r in before):  # WAIT, or a two-trip path
            op.set_phase(pb2.UPDATE_PHASE_PAUSING)
            try:
                await gen.pause_engine(
                    plan.pause_mode,
                    False,
                    None if plan.pause_mode != "wait" else max(self._deadline - time.time(), 0.0),
                    reason="update",
                )
            except asyncio.TimeoutError:
                await gen.resume_engine()  # WAIT stopped admitting requests: undo it
                raise UpdateFailed(
                    Cause.UPDATE_TIMEOUT,
                    "requests did not drain (pause_mode WAIT) within the "
                    f"update's timeout ({plan.timeout:.3f}s); generation was resumed",
                    modified=False,
                ) from None
            paused_by_update = True
        elif not paused_by_update and gen.partial and not gen.caller_paused:
            # Held paused by an earlier partial update: a success here resumes.
            paused_by_update = True
        op.record_paused_by_update(paused_by_update)
        caller_held = not paused_by_update and gen.caller_paused
        return UpdatePause(paused_by_update, in_flight, time.monotonic() - pause_started, caller_held)

    async def _check(self, recovering: bool) -> None:
        """Before generation runs on the new weights: every worker's model computes finite
        values with the bytes the loads wrote into it, and after a partial update every KV
        cache is zeroed (worker/weights/checks.py, docs/weights.md "The check after every
        load"). A layer that computes NaN or infinity fails the update as written
        (PARTIAL_UPDATE, cause WEIGHTS_NOT_FINITE), named; so does one that computes with other
        bytes than it was written (cause WEIGHTS_MISMATCH)."""
        checks = await self._parts.engine.check_loaded(clear_kv=recovering)
        rebuilt = sorted({name for c in checks for name in c.rebuilt})
        if rebuilt:  # vLLM's reload left them stale (docs/weights.md, "The check after every load")
            log.info("kernels rebuilt from tied weights", operation=self._op.name, layers=rebuilt)
        failures = [failure for failure in map(_check_failure, checks) if failure is not None]
        if failures:
            raise failures[0]
        if recovering:
            log.info(
                "kv cache cleared after a partial update",
                operation=self._op.name,
                bytes=sum(c.kv_bytes_cleared for c in checks),
                seconds=round(max((c.seconds for c in checks), default=0.0), 4),
            )

    async def _finish(self, resume: bool, reset_cache: bool) -> VersionState:
        """After a successful load: reset the cache, stamp, resume (where the path does it in
        one round trip per rank), fingerprint and record the version; the marks get "finish"
        and "fingerprint". The declaration's fingerprint (a pass over the weights) follows the
        finishing trip, generation running: no update can change the weights before this one
        is recorded."""
        plan, parts = self._plan, self._parts
        # No version: the new weights are undeclared, and so are the tokens they generate.
        label = plan.version if plan.version is not None else UNDECLARED_LABEL
        published = await parts.generation.path.finish(reset_cache, label, resume)
        self._marks.append(("finish", time.monotonic()))
        fingerprint = await parts.fingerprints.declaration() if plan.version is not None else None
        self._marks.append(("fingerprint", time.monotonic()))
        return await parts.ledger.record_update(plan.version, plan.source, fingerprint, published=published)

    def _succeeded(self, state: VersionState, results: list[LoadResult], resumed: bool) -> None:
        op, plan, started = self._op, self._plan, self._started
        op.finish(
            response=success_response(plan, state, results, started, self._pause_state, resumed, self._cache_reset)
        )
        report_finished(self._parts.on_finished, op, plan, "ok", sum(r.bytes_loaded for r in results))
        log.info(
            "weights updated",
            operation=op.name,
            source=plan.source.value,
            version=plan.version,
            tensors=len(plan.tensors),
            bytes=plan.bytes_total,
            seconds=round(time.monotonic() - started, 3),
            # Where the time went: pausing, receiving and loading, the finishing round trip
            # (cache reset, version stamp, resume: generation is paused until it ends), and
            # the declaration's fingerprint, taken after generation resumed.
            phases_ms={
                name: round((at - before) * 1e3, 1)
                for (name, at), before in zip(self._marks, [started] + [at for _, at in self._marks], strict=False)
            },
        )

    async def _fail(self, failure: UpdateFailed) -> None:
        parts, op, plan = self._parts, self._op, self._plan
        gen = parts.generation
        paused_by_update = self._pause_state.resumes
        op.set_phase(pb2.UPDATE_PHASE_FAILED)
        op.record_modified(failure.modified)
        if failure.modified:
            await gen.set_partial(True)
            parts.ledger.record_failure(
                Failure(  # the write lock is still held (see run)
                    reason=Reason.PARTIAL_UPDATE,
                    cause=failure.cause,
                    message=failure.message,
                    time=time.time(),
                    attempted_version=plan.version or "",
                    operation=op.name,
                )
            )
            try:  # tokens generated over mixed weights (after a forced resume) name no version
                await parts.engine.set_weight_version(UNDECLARED_LABEL)
            except ControlPlaneError:
                log.exception("unstamping the version after a partial update failed", operation=op.name)
            if not paused_by_update:
                # Generation was running under someone else's pause (e.g. vLLM's own API):
                # hold it paused all the same; the weights may be mixed.
                await gen.pause_engine("keep", False, None, reason="update")
        else:
            try:
                if paused_by_update and not gen.caller_paused and not gen.partial:
                    await gen.resume_engine()
                elif paused_by_update and gen.caller_paused:
                    # PauseGeneration(KEEP) arrived meanwhile: the pause is the caller's now.
                    await gen.path.hold(PauseReason.CALLER)
            except ControlPlaneError:
                log.exception("resuming (or handing the pause over) after a failed update failed", operation=op.name)
        await self._source.failed(failure.cause)
        op.fail(failure.error(op.name))
        cancelled = failure.cause == Cause.UPDATE_CANCELLED
        result = "partial" if failure.modified else "cancelled" if cancelled else "failed"
        report_finished(parts.on_finished, op, plan, result, 0)
        log.warning(
            "weight update failed",
            operation=op.name,
            cause=failure.cause,
            partial=failure.modified,
            message=failure.message,
        )


def _check_failure(check: LoadCheck) -> UpdateFailed | None:
    """What one worker's check after the load fails the update with, if anything: named, and
    as written (modified)."""
    where = f"(DP rank {check.dp_rank}, worker {check.worker_rank}); the weights are not served"
    ranks = {"dp_rank": str(check.dp_rank), "worker": str(check.worker_rank)}
    if check.not_finite:
        message = f"{check.not_finite} computes NaN or infinity after the load {where}"
        return UpdateFailed(
            Cause.WEIGHTS_NOT_FINITE, message, modified=True, metadata={"tensor": check.not_finite, **ranks}
        )
    if check.mismatch_layer:
        message = f"{check.mismatch_layer} does not compute with the weights written into it: {check.mismatch} {where}"
        return UpdateFailed(
            Cause.WEIGHTS_MISMATCH, message, modified=True, metadata={"layer": check.mismatch_layer, **ranks}
        )
    return None
