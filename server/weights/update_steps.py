"""The steps of an update that decide how generation and the version end up: pausing for it,
finishing it (cache, version stamp, resume, fingerprint), and ending its Operation on success
or failure.

Runs in the `enginectl serve` process, on the control loop, as part of WeightUpdates
(updates.py runs an update from start to end and calls these; the rules are those of
docs/architecture.md, "The update state machine").
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import structlog

from enginectl.contract.engine import UNDECLARED_LABEL, Cause, FinishUpdate, LoadResult, PauseReason
from enginectl.server.errors import ControlPlaneError, Reason, to_status
from enginectl.server.weights.engine_protocols import UpdateEngine
from enginectl.server.weights.fingerprints import WeightFingerprints
from enginectl.server.weights.generation import Generation
from enginectl.server.weights.groups import BREAKING_CAUSES, UpdateGroups
from enginectl.server.weights.ledger import Failure, Fingerprint, VersionState, WeightVersionLedger
from enginectl.server.weights.operations import UpdateOperation
from enginectl.server.weights.outcome import UpdateFailed, UpdatePause, success_response
from enginectl.server.weights.plans import UpdatePlan
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.updates")


class UpdateSteps:
    """Pause, finish and the two endings of an update (mixed into WeightUpdates, which sets
    what is declared here)."""

    _engine: UpdateEngine
    _ledger: WeightVersionLedger
    _on_finished: Callable[[str, str, int, float], None] | None
    generation: Generation
    groups: UpdateGroups
    fingerprints: WeightFingerprints

    async def declaration_fingerprint(self) -> Fingerprint:
        """Recorded at every declaration (see fingerprints.py)."""
        return await self.fingerprints.declaration()

    async def _pause_for(self, op: UpdateOperation, plan: UpdatePlan, deadline: float) -> UpdatePause:
        """Pause generation for the update unless it is paused already: (paused by the update,
        requests in flight at the start, seconds the pause took)."""
        gen = self.generation
        pause_started = time.monotonic()
        paused_by_update = False
        if gen.utilities and plan.pause_mode != "wait":  # the state read and the pause: one trip
            op.set_phase(pb2.UPDATE_PHASE_PAUSING)
            before, paused_by_update = await gen.pause_if_running(plan.pause_mode)
        else:
            before = await gen.ranks()
        gen.ranks_at_update_start = before
        in_flight = sum(r.running + r.waiting for r in before)
        if not paused_by_update and not any(r.paused for r in before):  # WAIT, or no utilities
            op.set_phase(pb2.UPDATE_PHASE_PAUSING)
            try:
                await gen.pause_engine(
                    plan.pause_mode,
                    False,
                    None if plan.pause_mode != "wait" else max(deadline - time.time(), 0.0),
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
        op.metadata.paused_by_update = paused_by_update
        caller_held = not paused_by_update and gen.caller_paused
        return UpdatePause(paused_by_update, in_flight, time.monotonic() - pause_started, caller_held)

    async def _finish(self, plan: UpdatePlan, resume: bool, marks: list[tuple[str, float]]) -> VersionState:
        """After a successful load: reset the cache, stamp, resume, fingerprint and record the
        version; `marks` gets "finish" (generation resumed) and "fingerprint"."""
        if self.generation.utilities:
            # Cache reset, version stamp and resume: one round trip per rank. The declaration's
            # fingerprint (a pass over the weights: tens of ms) follows, generation running:
            # no update can change the weights before this one is recorded.
            token = uuid.uuid4().hex if plan.version is not None else ""
            # No version: the new weights are undeclared, and so are the tokens they generate.
            label = plan.version if plan.version is not None else UNDECLARED_LABEL
            await self._engine.finish_update(FinishUpdate(plan.reset_cache, "", label, resume))
            marks.append(("finish", time.monotonic()))
            digests = await self._engine.declare_fingerprint(token) if token else []
            marks.append(("fingerprint", time.monotonic()))
            fingerprint = self.fingerprints.declared(token, digests) if token else None
            return await self._ledger.record_update(plan.version, plan.source, fingerprint, published=True)
        if plan.reset_cache:
            await self._engine.reset_prefix_cache()
        marks.append(("finish", time.monotonic()))
        fingerprint = await self.declaration_fingerprint() if plan.version is not None else None
        marks.append(("fingerprint", time.monotonic()))
        return await self._ledger.record_update(plan.version, plan.source, fingerprint)

    def _succeeded(
        self,
        op: UpdateOperation,
        plan: UpdatePlan,
        state: VersionState,
        results: list[LoadResult],
        started: float,
        pause: UpdatePause,
        resumed: bool,
        marks: list[tuple[str, float]],
    ) -> None:
        op.finish(response=success_response(plan, state, results, started, pause, resumed))
        self._report(op, plan, "ok", sum(r.bytes_loaded for r in results))
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
                for (name, at), before in zip(marks, [started] + [at for _, at in marks], strict=False)
            },
        )

    async def _fail(self, op: UpdateOperation, plan: UpdatePlan, failure: UpdateFailed, paused_by_update: bool) -> None:
        gen = self.generation
        op.set_phase(pb2.UPDATE_PHASE_FAILED)
        op.metadata.weights_modified = failure.modified
        if failure.modified:
            await gen.set_partial(True)
            self._ledger.record_failure(
                Failure(  # the write lock is still held (see _run)
                    reason=Reason.PARTIAL_UPDATE,
                    cause=failure.cause,
                    message=failure.message,
                    time=time.time(),
                    attempted_version=plan.version or "",
                    operation=op.name,
                )
            )
            try:  # tokens generated over mixed weights (after a forced resume) name no version
                await self._engine.set_weight_version(UNDECLARED_LABEL)
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
                elif paused_by_update and gen.caller_paused and gen.utilities:
                    # PauseGeneration(KEEP) arrived meanwhile: the pause is the caller's now.
                    await self._engine.hold(PauseReason.CALLER)
            except ControlPlaneError:
                log.exception("resuming (or handing the pause over) after a failed update failed", operation=op.name)
        error = failure.error(op.name)
        if plan.group and failure.cause in BREAKING_CAUSES:
            await self.groups.drop(plan.group)
        op.failure = error
        op.finish(error=to_status(error))
        cancelled = failure.cause == Cause.UPDATE_CANCELLED
        self._report(op, plan, "partial" if failure.modified else "cancelled" if cancelled else "failed", 0)
        log.warning(
            "weight update failed",
            operation=op.name,
            cause=failure.cause,
            partial=failure.modified,
            message=failure.message,
        )

    def _report(self, op: UpdateOperation, plan: UpdatePlan, result: str, nbytes: int) -> None:
        """Tell `on_finished` how `op` ended; its duration is the Operation's (end_time - start_time)."""
        if self._on_finished is not None:
            nanos = op.metadata.end_time.ToNanoseconds() - op.metadata.start_time.ToNanoseconds()
            self._on_finished(plan.source.value.lower(), result, nbytes, max(nanos, 0) / 1e9)
