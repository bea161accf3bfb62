"""RankWatch: the head's watch over the ranks that run on other hosts (DESIGN §13 "Liveness").

Runs in the `enginectl serve` process, on the control loop, from the moment the census and
CONFIGURE are done (server/wiring.py) until the server stops. A local EngineCore's death is
seen the moment its process exits (server/engine.py watches the sentinels of the processes this
process started); a rank on another node is no child of ours, and vLLM sends nothing when it
dies: without this, every call that waits for all ranks would wait for it for ever.

What it watches is the rank's FPM publisher (worker/fpm/publisher.py): a thread of its own in
the EngineCore that sends a sample at least every heartbeat interval (1 s by default), also
while the engine thread is inside a long weight load. A ping by EngineCore utility would queue
behind that load on the engine thread and read as silence. Every CHECK_INTERVAL_S the watch
reads, per remote rank, the arrival time of its latest keyed frame at the relay
(FpmRelay.last_seen); a rank silent for longer than the bound (--liveness-timeout, 10 s by
default) is a dead engine: `lost(cause)` (EngineAdapter.rank_lost) with the rank, its host and
the silence in the cause, which ends the server as a local EngineCore's death does (NOT_SERVING,
streams ended, exit non-zero).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import structlog

from enginectl.server.fpm.relay import FpmRelay

log = structlog.get_logger("enginectl.rank_watch")

CHECK_INTERVAL_S = 1.0


class RankWatch:
    """Watches `remote` (dp_rank -> host) through `relay`'s arrivals; calls `lost` once."""

    def __init__(
        self,
        relay: FpmRelay,
        remote: Mapping[int, str],
        *,
        bound_s: float,
        lost: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._relay = relay
        self._remote = dict(remote)
        self._bound_s = bound_s
        self._lost = lost
        self._clock = clock
        self._since = clock()  # a rank that never published is silent from the start of the watch
        self._task: asyncio.Task[None] | None = None

    def start(self) -> RankWatch:
        """Start watching, on the running (control) loop; nothing to watch on one host."""
        if self._remote:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="enginectl-rank-watch")
            log.info("watching remote ranks", ranks=self._remote, bound_s=self._bound_s)
        return self

    def silent(self) -> tuple[int, str, float] | None:
        """The first remote rank silent past the bound: (dp_rank, host, seconds), else None."""
        now = self._clock()
        for dp_rank, host in sorted(self._remote.items()):
            silence = now - max(self._relay.last_seen.get(dp_rank, self._since), self._since)
            if silence > self._bound_s:
                return dp_rank, host, silence
        return None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            found = self.silent()
            if found is not None:
                dp_rank, host, silence = found
                cause = (
                    f"rank {dp_rank} on host {host} has been silent for {silence:.1f}s "
                    f"(bound {self._bound_s:.1f}s): its node died or can no longer reach this head"
                )
                log.error("rank_lost", dp_rank=dp_rank, host=host, silent_s=round(silence, 1))
                self._lost(cause)
                return

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
