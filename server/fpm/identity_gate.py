"""IdentityGate: what the worker identity holds back in `enginectl serve`, and its failure policy.

Runs in the `enginectl serve` process, built on the main loop before the engine starts
(server/wiring.py). In `--await-worker-id` mode it holds back SERVING until
SetWorkerIdentity has succeeded on every rank, and shuts the server down (exit code 1) when a
sync fails, unless `--identity-sync-failure retry` says otherwise. IdentitySync (identity.py)
reports each sync's outcome to it from the control loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

log = structlog.get_logger("enginectl.fpm")


class IdentityGate:
    """Health gating and failure policy of the worker identity for one `enginectl serve`.

    Created on the main loop; `outcome` is called from the control loop (by IdentitySync)."""

    def __init__(
        self, *, await_worker_id: bool, exit_on_failure: bool, loop: asyncio.AbstractEventLoop, stop: asyncio.Event
    ) -> None:
        self.await_worker_id = await_worker_id
        self.exit_on_failure = exit_on_failure
        self.exit_code = 0
        self._loop = loop
        self._stop = stop
        self._synced = asyncio.Event()

    def outcome(self, ok: bool) -> None:
        """A SetWorkerIdentity reached the ranks: all acked (`ok`) or not. Thread-safe."""
        try:
            self._loop.call_soon_threadsafe(self._apply, ok)
        except RuntimeError:  # the main loop already closed: the server is gone anyway
            pass

    def _apply(self, ok: bool) -> None:
        if ok:
            self._synced.set()
        elif self.await_worker_id and self.exit_on_failure:
            log.error("identity_sync_failed", action="shutting down (--await-worker-id)")
            self.exit_code = 1
            self._stop.set()
        else:
            log.warning("identity_sync_failed", action="waiting for another SetWorkerIdentity")

    async def wait_until_identified(self, http: asyncio.Task[Any], **fields: Any) -> None:
        """In `--await-worker-id` mode, log `awaiting_worker_id` (with `fields`, e.g. the
        ports) and return once every rank acked a SetWorkerIdentity, the server is stopping,
        or the HTTP server ended. Returns at once otherwise."""
        if not self.await_worker_id:
            return
        log.info("awaiting_worker_id", **fields)
        waits = {asyncio.ensure_future(self._synced.wait()), asyncio.ensure_future(self._stop.wait())}
        try:
            await asyncio.wait({*waits, http}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
