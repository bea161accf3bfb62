"""HeartbeatTimer: when a data-parallel rank owes a heartbeat, and whether it may say `idle`.

Runs inside each EngineCore process (driven by the FPM publisher), but is pure: no vLLM, no
threads, no ZMQ; the clock is injected so the rule can be tested with a fake one.

The rule (docs/fpm.md "Worker identity", heartbeats):
- a heartbeat is due once no sample (step or heartbeat) was made for `interval_s`, so an idle
  rank sends one every `interval_s`, and a rank stuck in one long step sends one every
  `interval_s` of that step;
- a heartbeat is `idle` only when no step is in flight and the rank has no running and no
  waiting request: a long step, or requests held while generation is paused, is never
  reported as idle.

Not thread-safe by itself: the publisher calls it under its own lock. The rank's activity
(steps in flight, running and waiting requests) is passed in when a heartbeat is considered,
so the engine thread does no timer bookkeeping per step beyond `sample_made`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0


class HeartbeatTimer:
    """Tracks the last sample and the steps in flight of one rank."""

    def __init__(
        self, interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self._clock = clock
        self._last_sample = clock()  # the rank's start counts as its last sign of life

    def sample_made(self) -> None:
        """A sample (step or heartbeat) was made now: the next heartbeat is an interval away."""
        self._last_sample = self._clock()

    def seconds_until_due(self) -> float:
        """Seconds until a heartbeat is due; 0 when it is due now."""
        return max(0.0, self._last_sample + self.interval_s - self._clock())

    def poll(self, steps_in_flight: int, num_running: int, num_waiting: int) -> bool | None:
        """None if no heartbeat is due; otherwise its `idle` flag, given the steps scheduled
        whose output is not processed yet and the rank's requests. The caller must then make
        the heartbeat and call `sample_made`."""
        if self.seconds_until_due() > 0:
            return None
        return is_idle(steps_in_flight, num_running, num_waiting)


def is_idle(steps_in_flight: int, num_running: int, num_waiting: int) -> bool:
    """A heartbeat's `idle` flag: no step in flight, no running and no waiting request."""
    return steps_in_flight == 0 and num_running == 0 and num_waiting == 0
