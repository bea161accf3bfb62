"""The two ways this server pauses, resumes and finishes on an engine, behind one interface.

Runs in the `enginectl serve` process, on the control loop. Which one applies is learnt once,
before serving (Generation.prepare):
- `UtilityPath`: every EngineCore has enginectl's utilities (worker/engine_core.py). A pause
  or a resume answers the ranks' states from just before it in the same round trip, names
  who holds the pause (the ranks' FPM samples say it), and an update's finish (cache reset,
  version stamp, resume) is one round trip per rank;
- `VllmPath`: the user's own scheduler replaced enginectl's on a multi-worker engine, so only
  vLLM's own utilities answer: a state read and a pause are two trips, a pause names nobody,
  and an update resumes after the ledger recorded it.
Generation (generation.py) and an update's run (run.py) call these and never ask which path
they have.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from enginectl.contract.engine import FinishUpdate, PauseReason, RankGenerationState
from enginectl.server.weights.engine_protocols import PauseEngine


class PausePath(ABC):
    """How generation is paused, resumed and an update finished on this engine."""

    def __init__(self, engine: PauseEngine) -> None:
        self._engine = engine

    @abstractmethod
    async def ranks(self) -> list[RankGenerationState]:
        """Every rank's generation state."""

    @abstractmethod
    async def pause(self, mode: str, clear_cache: bool, holder: PauseReason) -> None:
        """Pause every rank with `mode`, for `holder`."""

    @abstractmethod
    async def pause_reporting(self, mode: str, clear_cache: bool, holder: PauseReason) -> list[RankGenerationState]:
        """Pause every rank with `mode` (KEEP or ABORT), for `holder`: their states from just
        before the pause."""

    @abstractmethod
    async def pause_if_running(
        self, mode: str, holder: PauseReason, pausing: Callable[[], None]
    ) -> tuple[list[RankGenerationState], bool]:
        """An update's pause with `mode` (KEEP or ABORT), for `holder`, in the round trip that
        reads the states, when the path can: (states before, whether it paused every rank).
        `pausing` is called just before a pause is sent. A path that cannot answers the
        states and pauses nothing; the update then pauses with `pause`."""

    @abstractmethod
    async def resume_reporting(self) -> list[RankGenerationState]:
        """Resume every rank: their states from just before the resume."""

    @abstractmethod
    async def hold(self, holder: PauseReason) -> None:
        """The pause in effect is `holder`'s now (nothing where a pause names nobody)."""

    @abstractmethod
    async def finish(self, reset_cache: bool, label: str, resume: bool) -> bool:
        """After an update's load: reset the prefix cache if asked and, where one round trip
        does it all, stamp `label` and resume if `resume`. True: the label is stamped and
        generation resumed (if asked); False: the ledger stamps it, and `resume_after_finish`
        resumes."""

    @abstractmethod
    async def resume_after_finish(self) -> None:
        """Resume after an update that `finish` did not resume."""


class UtilityPath(PausePath):
    """enginectl's EngineCore utilities: state and pause in one trip, pauses name who holds them."""

    async def ranks(self) -> list[RankGenerationState]:
        return await self._engine.generation_state()

    async def pause(self, mode: str, clear_cache: bool, holder: PauseReason) -> None:
        await self._engine.pause_reporting(mode, clear_cache, holder)

    async def pause_reporting(self, mode: str, clear_cache: bool, holder: PauseReason) -> list[RankGenerationState]:
        return await self._engine.pause_reporting(mode, clear_cache, holder)

    async def pause_if_running(
        self, mode: str, holder: PauseReason, pausing: Callable[[], None]
    ) -> tuple[list[RankGenerationState], bool]:
        # Each rank answers its state from just before, and pauses only if it was running.
        pausing()
        before = await self._engine.pause_reporting(mode, False, holder, if_running=True)
        return before, not any(r.paused for r in before)

    async def resume_reporting(self) -> list[RankGenerationState]:
        return await self._engine.resume_reporting()

    async def hold(self, holder: PauseReason) -> None:
        await self._engine.hold(holder)

    async def finish(self, reset_cache: bool, label: str, resume: bool) -> bool:
        await self._engine.finish_update(FinishUpdate(reset_cache, "", label, resume))
        return True

    async def resume_after_finish(self) -> None:
        pass  # `finish` resumed


class VllmPath(PausePath):
    """vLLM's own utilities only (EngineCores without enginectl's): less detail, more trips."""

    async def ranks(self) -> list[RankGenerationState]:
        return [RankGenerationState(i, p) for i, p in enumerate(await self._engine.is_paused())]

    async def pause(self, mode: str, clear_cache: bool, holder: PauseReason) -> None:
        await self._engine.pause(mode, clear_cache)

    async def pause_reporting(self, mode: str, clear_cache: bool, holder: PauseReason) -> list[RankGenerationState]:
        before = await self.ranks()
        await self._engine.pause(mode, clear_cache)
        return before

    async def pause_if_running(
        self, mode: str, holder: PauseReason, pausing: Callable[[], None]
    ) -> tuple[list[RankGenerationState], bool]:
        return await self.ranks(), False

    async def resume_reporting(self) -> list[RankGenerationState]:
        before = await self.ranks()
        await self._engine.resume()
        return before

    async def hold(self, holder: PauseReason) -> None:
        pass  # vLLM's pause names nobody

    async def finish(self, reset_cache: bool, label: str, resume: bool) -> bool:
        if reset_cache:
            await self._engine.reset_prefix_cache()
        return False

    async def resume_after_finish(self) -> None:
        await self._engine.resume()
