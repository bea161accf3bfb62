"""RankGeneration: the one place a rank's generation state lives, as its FPM samples report it.

Runs inside each EngineCore process. Pure: no vLLM, no ZMQ (the scheduler and the EngineCore
utilities drive it). What changes it, all on the engine thread:
- every change of the scheduler's pause state (FpmScheduler.set_pause_state, which every
  pause and resume goes through, enginectl's or vLLM's own): paused or running;
- who paused: enginectl's pause utility names the reason for the pause it makes (`pausing`);
  a pause made any other way (vLLM's HTTP `/pause`) is EXTERNAL; `hold` relabels the pause in
  effect (a partial update, or an update that ended with generation held for the caller);
- a weight load on this rank (`applying`, around the load's worker RPC).

Readers (the step path on the engine thread, the heartbeat path on the publisher thread) read
`current`, an immutable GenerationStatus replaced in one store, so they need no lock. Every
change calls `on_change` (the publisher makes a sample at once: docs/fpm.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from enginectl.contract.engine import PauseReason
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2


class GenerationStatus(NamedTuple):
    """ForwardPassMetrics.generation_state and pause_reason, as proto enum values."""

    state: fpm_pb2.GenerationState.ValueType
    pause_reason: fpm_pb2.PauseReason.ValueType


RUNNING = GenerationStatus(fpm_pb2.GENERATION_STATE_RUNNING, fpm_pb2.PAUSE_REASON_UNSPECIFIED)

# contract PauseReason -> the proto value (the same names).
PROTO_REASON = {reason: fpm_pb2.PauseReason.Value(f"PAUSE_REASON_{reason.value}") for reason in PauseReason}


class RankGeneration:
    """A rank's generation state; see the module docstring. Mutators run on the engine thread."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.on_change = on_change
        self.current = RUNNING
        self._paused = False
        self._reason = PauseReason.EXTERNAL  # who holds the pause, while paused
        self._next: PauseReason | None = None  # the reason of the pause being made now
        self._applying = False

    @contextmanager
    def pausing(self, reason: PauseReason) -> Iterator[None]:
        """A pause made inside this block (by enginectl's pause utility) is held by `reason`."""
        self._next = reason
        try:
            yield
        finally:
            self._next = None

    def scheduler_paused(self, paused: bool) -> None:
        """The scheduler's pause state was set (any pause or resume, whoever made it).

        A pause made outside `pausing` is EXTERNAL, unless generation was paused already: then
        whoever held it still does (vLLM's `/pause` over enginectl's pause changes nothing)."""
        if not paused:
            self._paused = False
        elif self._next is not None:
            self._paused, self._reason = True, self._next
        elif not self._paused:
            self._paused, self._reason = True, PauseReason.EXTERNAL
        self._publish()

    def hold(self, reason: PauseReason) -> None:
        """The pause in effect is now held by `reason` (nothing when not paused)."""
        if self._paused:
            self._reason = reason
            self._publish()

    def update_finished_paused(self) -> None:
        """An update succeeded and left generation paused: a pause the update held (or that a
        partial update had left) is now the caller's, whose PauseGeneration kept it (the server
        resumes otherwise); any other holder keeps it."""
        if self._reason in (PauseReason.UPDATE, PauseReason.PARTIAL_UPDATE):
            self.hold(PauseReason.CALLER)

    @contextmanager
    def applying(self) -> Iterator[None]:
        """A weight load writes this rank's weights inside this block."""
        self._applying = True
        self._publish()
        try:
            yield
        finally:
            self._applying = False
            self._publish()

    def _publish(self) -> None:
        reason = PROTO_REASON[self._reason] if self._paused else fpm_pb2.PAUSE_REASON_UNSPECIFIED
        if self._applying:
            status = GenerationStatus(fpm_pb2.GENERATION_STATE_APPLYING, reason)
        elif self._paused:
            status = GenerationStatus(fpm_pb2.GENERATION_STATE_PAUSED, reason)
        else:
            status = RUNNING
        if status != self.current:
            self.current = status
            if self.on_change is not None:
                self.on_change()
