"""Generation: whether the engine generates, who paused it, and the update that holds it.

Runs in the `enginectl serve` process, on the control loop. The pause state and the running
update live together because every rule reads both: a caller's pause during an update only
marks generation to stay paused after it; ABORT and WAIT need an idle engine; a partial
update holds generation paused until an update succeeds or a forced resume
(docs/architecture.md, "The update state machine"). How the engine is paused is its pause
path (pause_paths.py), chosen once by `prepare`; where the path names who holds a pause, it is
named with the same precedence as `state`, so each rank's FPM samples say the same
(docs/fpm.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from enginectl.contract.engine import PauseReason, RankGenerationState
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.limits import MAX_TIMEOUT_S
from enginectl.server.weights.convert import PAUSE_MODE_PROTO, duration, parse_pause_mode, parse_timeout
from enginectl.server.weights.engine_protocols import PauseEngine
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.update.pause_paths import PausePath, UtilityPath, VllmPath
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.generation")


class Generation:
    """The pause state of every rank as this server knows it, and the running update."""

    def __init__(
        self,
        engine: PauseEngine,
        ranks: Sequence[int],
        on_pause: Callable[[str | None], None] | None = None,
        on_partial: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self._engine = engine
        # Hears every change between running and paused: who paused ("update" or "caller"),
        # None on resume (the metrics' pause clock).
        self._on_pause = on_pause
        self.caller_paused = False  # PauseGeneration holds generation (until ResumeGeneration)
        self.partial = False  # held paused after a partial update (set through set_partial)
        # The weights may be mixed: from a partial update until an update succeeds. A forced
        # resume ends `partial` (generation runs) but not this: no router may take the engine
        # for serving weights nobody can name (docs/operations.md, "Quarantine").
        self.quarantined = False
        # Hears every change of `quarantined`, before the call that changed it answers: gRPC
        # health goes NOT_SERVING while the weights may be mixed.
        self._on_partial = on_partial
        self.mode = ""  # the mode of the pause in effect ("" when running)
        self.pause_time: float | None = None
        self._active: UpdateOperation | None = None  # the update running, or last run
        # vLLM's own utilities until `prepare` found enginectl's on every EngineCore.
        self._path: PausePath = VllmPath(engine)
        self._ranks_at_update_start = [RankGenerationState(r, False) for r in ranks]  # the managed ranks

    async def prepare(self) -> None:
        """Once, before serving: choose the pause path. enginectl's utilities answer on every
        EngineCore unless the user's own scheduler replaced enginectl's on a multi-worker engine."""
        try:
            await self._engine.generation_state()
            self._path = UtilityPath(self._engine)
        except ControlPlaneError:
            if self._engine.errored:
                raise

    @property
    def path(self) -> PausePath:
        """How this engine is paused, resumed and an update finished (see `prepare`)."""
        return self._path

    async def set_partial(self, partial: bool) -> None:
        """True: an update failed part-way (generation held paused, quarantined); False: an
        update succeeded (neither)."""
        changed = partial != self.partial
        self.partial = partial
        if changed and partial:
            # The ranks' pause is the partial update's now (their FPM samples say so). On the
            # failure path only; an operation must still end if the engine does not answer.
            try:
                await self._path.hold(PauseReason.PARTIAL_UPDATE)
            except ControlPlaneError:
                log.exception("labelling the pause of a partial update failed")
        quarantine_changed = partial != self.quarantined
        self.quarantined = partial
        if quarantine_changed and self._on_partial is not None:
            await self._on_partial(partial)

    def _holder(self, reason: str) -> PauseReason:
        """Who holds a pause made now for `reason` ("update" or "caller"), as `state` will
        report it: a partial update holds over anyone."""
        if self.partial:
            return PauseReason.PARTIAL_UPDATE
        return PauseReason.UPDATE if reason == "update" else PauseReason.CALLER

    @property
    def active(self) -> UpdateOperation | None:
        """The update running (or the last one run)."""
        return self._active

    def update_began(self, op: UpdateOperation) -> None:
        """`op` holds generation: from here on another update is refused."""
        self._active = op

    def update_started_from(self, ranks: list[RankGenerationState]) -> None:
        """The ranks' states when the running update paused them (what `state` reports while
        the EngineCores are busy loading)."""
        self._ranks_at_update_start = ranks

    def update_ended(self, op: UpdateOperation) -> None:
        """`op` ended (or never began: its caller went away before the ledger's lock)."""
        if self._active is op:
            self._active = None

    def updating(self) -> bool:
        return self._active is not None and not self._active.done

    def in_progress(self, why: str) -> ControlPlaneError:
        """UPDATE_IN_PROGRESS, naming the running update."""
        assert self.active is not None
        return ControlPlaneError(
            grpc.StatusCode.ABORTED,
            Reason.UPDATE_IN_PROGRESS,
            f"{self.active.name} is running; {why} (a trainer taking over ends it first: "
            f"CancelOperation(name={self.active.name!r}))",
            metadata={"operation": self.active.name},
        )

    async def ranks(self) -> list[RankGenerationState]:
        return await self._path.ranks()

    async def state(self, known: list[RankGenerationState] | None = None) -> pb2.GenerationState:
        """The state as GetGenerationState reports it; `known`: per-rank states the caller
        already has (saves a round trip to every EngineCore)."""
        if self.updating():
            # The EngineCores are busy loading (they answer no utility until done): report
            # what the update started from, paused.
            ranks = [RankGenerationState(r.dp_rank, True, r.running, r.waiting) for r in self._ranks_at_update_start]
        else:
            ranks = known if known is not None else await self.ranks()
        state = pb2.GenerationState(
            paused=any(r.paused for r in ranks),
            num_running_requests=sum(r.running for r in ranks),
            num_waiting_requests=sum(r.waiting for r in ranks),
            ranks=[
                pb2.RankGenerationState(
                    dp_rank=r.dp_rank, paused=r.paused, num_running_requests=r.running, num_waiting_requests=r.waiting
                )
                for r in ranks
            ],
        )
        if state.paused:
            if self.updating() and not self.caller_paused:
                state.reason = pb2.PAUSE_REASON_UPDATE
            elif self.partial:
                state.reason = pb2.PAUSE_REASON_PARTIAL_UPDATE
            elif self.caller_paused:
                state.reason = pb2.PAUSE_REASON_CALLER
            else:
                state.reason = pb2.PAUSE_REASON_EXTERNAL
            if self.mode:
                state.mode = PAUSE_MODE_PROTO[self.mode]
            if self.pause_time is not None:
                state.pause_time.FromNanoseconds(int(self.pause_time * 1e9))
        if self.updating():
            assert self.active is not None
            state.update_operation = self.active.name
        return state

    async def pause_engine(self, mode: str, clear_cache: bool, timeout: float | None, reason: str = "caller") -> None:
        """Pause every rank; with `timeout` (WAIT), asyncio.TimeoutError if requests did not
        drain. `reason`: who pauses ("update" or "caller"), if generation was running."""
        call = self._path.pause(mode, clear_cache, self._holder(reason))
        if timeout is None:
            await call
        else:
            await asyncio.wait_for(call, timeout)
        self._paused(mode, reason)

    def _paused(self, mode: str, reason: str) -> None:
        """Every rank paused with `mode`."""
        if self.pause_time is None:
            self.pause_time = time.time()
            if self._on_pause is not None:
                self._on_pause(reason)
        self.mode = mode

    async def pause_if_running(self, mode: str, pausing: Callable[[], None]) -> tuple[list[RankGenerationState], bool]:
        """An update's pause (KEEP or ABORT) in the round trip that reads the states, where the
        path can (PausePath.pause_if_running): (states before, every rank was running and is
        paused now). `pausing` hears the moment a pause is sent."""
        before, paused = await self._path.pause_if_running(mode, self._holder("update"), pausing)
        if paused:
            self._paused(mode, "update")
        return before, paused

    async def resume_engine(self) -> None:
        await self._engine.resume()
        self.resumed()

    async def resume_after_update(self) -> None:
        """A successful update resumes generation: inside its finishing round trip, or now
        (PausePath.finish)."""
        self.resumed()
        await self._path.resume_after_finish()

    def resumed(self) -> None:
        """The engine resumed (here, or inside an update's last round trip)."""
        if self.pause_time is not None and self._on_pause is not None:
            self._on_pause(None)
        self.pause_time = None
        self.mode = ""

    async def pause(self, request: pb2.PauseGenerationRequest) -> pb2.PauseGenerationResponse:
        mode = parse_pause_mode("mode", request.mode)
        wait_timeout = parse_timeout(
            "wait_timeout", request.wait_timeout, request.HasField("wait_timeout"), default=MAX_TIMEOUT_S
        )
        if self.updating():
            if mode != "keep":
                raise self.in_progress(
                    f"{mode.upper()} needs the engine, which is loading weights; "
                    "KEEP marks generation to stay paused after the update"
                )
            self.caller_paused = True
            return pb2.PauseGenerationResponse(state=await self.state(), was_paused=True)
        started = time.monotonic()
        if mode != "wait":
            # KEEP and ABORT: the states before the pause, answered with it where the path can.
            before = await self._path.pause_reporting(mode, request.clear_cache, self._holder("caller"))
            self._paused(mode, "caller")
            return await self._paused_answer(mode, before, started)
        before = await self.ranks()
        was_paused = any(r.paused for r in before)
        try:
            await self.pause_engine(mode, request.clear_cache, wait_timeout if mode == "wait" else None)
        except asyncio.CancelledError:
            # The call's deadline passed (or the caller left) while WAIT drained: this call's
            # pause is undone, as when wait_timeout passes (weight_update_service.proto).
            if mode == "wait" and not was_paused:
                await asyncio.shield(self.resume_engine())
            raise
        except asyncio.TimeoutError:
            if not was_paused:
                await self.resume_engine()
            raise ControlPlaneError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                Reason.PAUSE_TIMEOUT,
                f"requests did not drain within {wait_timeout:.3f}s; generation was resumed"
                if not was_paused
                else f"requests did not drain within {wait_timeout:.3f}s",
            ) from None
        return await self._paused_answer(mode, before, started)

    async def _paused_answer(
        self, mode: str, before: list[RankGenerationState], started: float
    ) -> pb2.PauseGenerationResponse:
        """PauseGeneration's answer, once every rank paused; `before`: their states before."""
        was_paused = any(r.paused for r in before)
        self.caller_paused = True
        in_flight = sum(r.running + r.waiting for r in before)
        # Right after the pause: KEEP holds the requests where they were, ABORT ended them (no
        # round trip needed); WAIT took long enough for new arrivals to queue, so ask.
        after = (
            None
            if mode == "wait"
            else [
                RankGenerationState(r.dp_rank, True, r.running, r.waiting)
                if mode == "keep"
                else RankGenerationState(r.dp_rank, True)
                for r in before
            ]
        )
        return pb2.PauseGenerationResponse(
            state=await self.state(after),
            was_paused=was_paused,
            num_aborted_requests=in_flight if mode == "abort" else 0,
            num_paused_requests=in_flight if mode == "keep" else 0,
            pause_duration=duration(time.monotonic() - started),
        )

    async def resume(self, request: pb2.ResumeGenerationRequest) -> pb2.ResumeGenerationResponse:
        if self.updating():
            if self.caller_paused:
                self.caller_paused = False  # the update resumes when it ends
                return pb2.ResumeGenerationResponse(state=await self.state(), was_paused=True)
            raise self.in_progress("generation resumes when the update ends")
        if self.partial and not request.force:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.PARTIAL_UPDATE,
                "the last update failed part-way and the weights may be mixed: load weights again, "
                "or resume with force=true to generate with them anyway",
            )
        ranks = await self._path.resume_reporting()  # the states before resuming
        self.resumed()
        was_paused = any(r.paused for r in ranks)
        self.caller_paused = False
        if self.partial:  # forced: generation runs over the mixed weights, still quarantined
            self.partial = False
            log.warning("generation resumed by force over weights a partial update left; health stays NOT_SERVING")
        after = [RankGenerationState(r.dp_rank, False, r.running, r.waiting) for r in ranks]
        return pb2.ResumeGenerationResponse(state=await self.state(after), was_paused=was_paused)
