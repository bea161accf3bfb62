"""`enginectl serve` wiring of worker identity and the EngineCore FPM publisher.

Runs in the `enginectl serve` process. Before the engine starts, `configure_identity` checks
the flags and makes vLLM load enginectl's scheduler, and `IdentityGate.engine_config` turns
them into the EngineConfig (contract/engine.py) every EngineCore reads at start (worker id,
await mode, heartbeat interval, the server incarnation, the relay endpoint). Afterwards
`IdentityGate` holds back SERVING in `--await-worker-id` mode until SetWorkerIdentity has
succeeded on every rank, and shuts the server down (exit code 1) when a sync fails, unless
`--identity-sync-failure retry` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from enginectl.contract.engine import EngineConfig
from enginectl.server.errors import ControlPlaneError
from enginectl.server.fpm.identity import IdentitySync, check_worker_id

if TYPE_CHECKING:
    from enginectl.server.engine import EngineAdapter

log = structlog.get_logger("enginectl.fpm")

SCHEDULER = "enginectl.worker.fpm.scheduler.make_scheduler"
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0


def add_identity_args(group: argparse._ArgumentGroup) -> None:
    """The worker-identity flags of `enginectl serve`."""
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--worker-id",
        default="",
        help="Worker identity stamped on every forward-pass metrics sample of every "
        "data-parallel rank, from the first one (1 to 256 bytes of UTF-8).",
    )
    mode.add_argument(
        "--await-worker-id",
        action="store_true",
        help="Start without a worker identity: gRPC health stays NOT_SERVING and no "
        "sample leaves the relay until FpmIdentityService.SetWorkerIdentity succeeds "
        "on every rank (for pre-warmed or snapshot-restored engines).",
    )
    group.add_argument(
        "--identity-sync-failure",
        choices=("exit", "retry"),
        default="exit",
        help="With --await-worker-id, what a failed SetWorkerIdentity does: exit "
        "(default: shut the engine down and exit non-zero) or retry (log it and "
        "wait for another SetWorkerIdentity; health stays NOT_SERVING until one succeeds).",
    )
    group.add_argument(
        "--fpm-heartbeat-interval",
        type=float,
        default=DEFAULT_HEARTBEAT_INTERVAL_S,
        metavar="SECONDS",
        help="Each rank sends a heartbeat sample after this long without a step "
        f"(default {DEFAULT_HEARTBEAT_INTERVAL_S}).",
    )


class IdentityGate:
    """Health gating and failure policy of the worker identity for one `enginectl serve`.

    Created on the main loop; `outcome` is called from the control loop (by IdentitySync)."""

    def __init__(
        self,
        *,
        await_worker_id: bool,
        exit_on_failure: bool,
        incarnation: str,
        loop: asyncio.AbstractEventLoop,
        stop: asyncio.Event,
        worker_id: str = "",
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.await_worker_id = await_worker_id
        self.exit_on_failure = exit_on_failure
        self.incarnation = incarnation  # the server's, handed to every EngineCore and the ledger
        self.worker_id = worker_id  # every rank's identity from the start ("" for none)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.exit_code = 0
        self._loop = loop
        self._stop = stop
        self._synced = asyncio.Event()

    def engine_config(self, fpm_endpoint: str) -> EngineConfig:
        """What every EngineCore of this start is handed (serve.py `hand_over_engine_config`)."""
        return EngineConfig(
            fpm_endpoint=fpm_endpoint,
            worker_id=self.worker_id,
            await_worker_id=self.await_worker_id,
            heartbeat_interval_s=self.heartbeat_interval_s,
            incarnation=self.incarnation,
        )

    def sync(self, engine: EngineAdapter, on_synced: Callable[[str], None] | None = None) -> IdentitySync:
        """The IdentitySync behind FpmIdentityService; build it on the control loop.
        `on_synced`: see IdentitySync (the metrics' counter)."""
        return IdentitySync(engine, await_worker_id=self.await_worker_id, on_outcome=self.outcome, on_synced=on_synced)

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


def configure_identity(args: argparse.Namespace, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> IdentityGate:
    """Validate the identity flags and make vLLM load enginectl's scheduler; the gate's
    `engine_config` is what the EngineCores are then handed. Call before the engine starts."""
    if args.worker_id:
        try:
            check_worker_id(args.worker_id)
        except ControlPlaneError as err:
            raise SystemExit(f"enginectl serve: --worker-id: {err.message}") from None
    if not args.fpm_heartbeat_interval > 0:
        raise SystemExit("enginectl serve: --fpm-heartbeat-interval must be more than 0")
    if args.scheduler_cls is None:
        args.scheduler_cls = SCHEDULER
    else:  # the user's own scheduler: it has neither the publisher nor the identity
        log.warning(
            "fpm_publisher_disabled",
            scheduler_cls=str(args.scheduler_cls),
            reason="--scheduler-cls is not enginectl's; SetWorkerIdentity will fail",
        )
    return IdentityGate(
        await_worker_id=bool(args.await_worker_id),
        exit_on_failure=args.identity_sync_failure == "exit",
        incarnation=secrets.token_hex(8),
        loop=loop,
        stop=stop,
        worker_id=args.worker_id,
        heartbeat_interval_s=float(args.fpm_heartbeat_interval),
    )
