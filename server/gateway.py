"""GatewayRegistration: this server's row in the SMG gateway, kept true (`--gateway URL`).

Runs in the `enginectl serve` process, on the control loop; every HTTP call to SMG (blocking,
common/gateway.py) goes through `asyncio.to_thread`, so the loop never waits on the gateway.

What it does (docs/rollouts.md, "Behind the SMG gateway"):
- `start()` registers in the background: serving never waits for the gateway, and a down or
  refusing gateway is retried with capped exponential backoff, each failed attempt logged.
- It follows the ledger's watch and PATCHes `weight_version` within about a second of every
  change: bursts coalesce to the newest state; undeclared (never declared, or after a partial
  update, which leaves the ledger undeclared) clears the label; a version SMG cannot carry
  clears it too and is reported. A worker SMG lost (404, e.g. SMG restarted) is registered
  again, on a PATCH or on the periodic check.
- `stop(timeout)` ends the follower and deregisters within the timeout, whatever the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from enginectl.common.gateway import (
    GatewayError,
    Registration,
    SmgWorkers,
    VersionLabels,
    registration,
    version_labels,
)
from enginectl.server.errors import ControlPlaneError
from enginectl.server.weights.version.ledger import LedgerClosed, VersionState, WeightVersionLedger

log = structlog.get_logger("enginectl.gateway")

T = TypeVar("T")

BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 10.0
RESYNC_INTERVAL_S = 10.0  # how often the row is checked when nothing changes (a lost worker, a lost PATCH)
READY_POLL_MAX_S = 1.0  # while SMG adds the worker, how often at most it is asked
DEREGISTER_TIMEOUT_S = 2.0  # stop(): the shutdown spends at most this on the gateway


class Backoff:
    """Capped exponential delays: `initial`, doubling, at most `maximum`; `reset()` after a success."""

    def __init__(self, initial: float = BACKOFF_INITIAL_S, maximum: float = BACKOFF_MAX_S) -> None:
        self.initial, self.maximum = initial, maximum
        self._next = initial

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self._next = self.initial


class GatewayRegistration:
    """Registers this server with SMG and keeps its `weight_version` label current.

    `workers` is the SMG client; `ledger` the version resource followed; the rest is what the
    registration says (common/gateway.py `registration`): the advertised host, the gRPC port
    (vLLM's VllmEngine) and HTTP port (the RL routes, `rl.control_url`), the server's token
    (SMG's `api_key` for the worker) and enginectl's version.
    """

    def __init__(
        self,
        workers: SmgWorkers,
        ledger: WeightVersionLedger,
        *,
        host: str,
        grpc_port: int,
        http_port: int,
        token: str | None,
        enginectl_version: str,
        backoff: Callable[[], Backoff] = Backoff,
        resync_interval_s: float = RESYNC_INTERVAL_S,
    ) -> None:
        self._workers = workers
        self._ledger = ledger
        self._host, self._grpc_port, self._http_port = host, grpc_port, http_port
        self._token = token
        self._enginectl_version = enginectl_version
        self._backoff = backoff
        self._resync_interval_s = resync_interval_s
        self._url = self._registration(ledger.state).url
        self._wanted = version_labels(ledger.state.declared, ledger.state.version)
        self._wanted_at = time.monotonic()
        self._changed = asyncio.Event()
        self._worker_id: str | None = None
        self._registered = False  # SMG holds the worker (not merely queued)
        self._posted = False  # a registration was sent: on stop, look the worker up by URL if its id is unknown
        self._last_sent: VersionLabels | None = None
        self._last_error: str | None = None
        self._reported: str | None = None  # the unrepresentable version last logged
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: asyncio.Task[Any] | None = None

    @property
    def url(self) -> str:
        """The worker URL registered (grpc://HOST:PORT)."""
        return self._url

    def status(self) -> dict[str, Any]:
        """What the registration is now, for logs: read-only, a fresh dict."""
        return {
            "gateway": self._workers.base_url,
            "url": self._url,
            "worker_id": self._worker_id,
            "registered": self._registered,
            "last_sent_version": None if self._last_sent is None else self._last_sent.version,
            "unrepresentable": self._wanted.unrepresentable,
            "last_error": self._last_error,
        }

    def start(self) -> None:
        """Register and follow the ledger in the background; returns at once."""
        assert not self._tasks, "started twice"
        self._tasks = [
            asyncio.create_task(self._follow_ledger(), name="gateway-ledger"),
            asyncio.create_task(self._sync(), name="gateway-sync"),
        ]

    async def stop(self, timeout: float = DEREGISTER_TIMEOUT_S) -> None:
        """End the follower, then DELETE the registration, all within `timeout` seconds; a
        gateway that is down or slow is logged and left."""
        deadline = time.monotonic() + timeout
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._inflight is not None and not self._inflight.done():  # a registration on its way
            await asyncio.wait({self._inflight}, timeout=max(0.0, deadline - time.monotonic()))
        if self._worker_id is None and not self._posted:
            return
        try:
            await asyncio.wait_for(self._deregister(deadline), max(0.0, deadline - time.monotonic()))
        except (GatewayError, asyncio.TimeoutError) as err:
            log.warning(
                "gateway_deregister_failed", gateway=self._workers.base_url, worker_id=self._worker_id, error=str(err)
            )
            return
        log.info("gateway_deregistered", gateway=self._workers.base_url, worker_id=self._worker_id, url=self._url)
        self._registered = False

    async def _deregister(self, deadline: float) -> None:
        worker_id = self._worker_id
        if worker_id is None:  # the registration's answer was lost: find it by its URL
            row = await asyncio.to_thread(self._workers.find_by_url, self._url)
            if row is None:
                return
            worker_id = self._worker_id = str(row["id"])
        await asyncio.to_thread(self._workers.deregister, worker_id, max(0.1, deadline - time.monotonic()))

    # --- the ledger ---------------------------------------------------------------------
    async def _follow_ledger(self) -> None:
        """Keep `_wanted` the labels of the ledger's newest state; wake the sync on a change."""
        while True:
            try:
                async for state in self._ledger.watch():
                    self._want(state)
            except LedgerClosed:
                return  # shutting down or the engine died: the stop deregisters
            except ControlPlaneError:  # fell behind the ledger's history: read the current state again
                self._want(self._ledger.state)

    def _want(self, state: VersionState) -> None:
        wanted = version_labels(state.declared, state.version)
        if wanted.unrepresentable and state.version != self._reported:
            self._reported = state.version
            log.warning(
                "gateway_weight_version_unrepresentable",
                version=state.version,
                label="",
                rule="SMG versions are printable ASCII without spaces, at most 128 bytes, not 'default'",
            )
        if wanted != self._wanted:
            self._wanted, self._wanted_at = wanted, time.monotonic()
            self._changed.set()

    # --- SMG ----------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """One blocking SMG call on a thread. Shielded: a stop that cancels the caller can
        still wait for a registration on its way (`stop`)."""
        self._inflight = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(self._inflight)

    def _registration(self, state: VersionState) -> Registration:
        return registration(
            host=self._host,
            grpc_port=self._grpc_port,
            http_port=self._http_port,
            token=self._token,
            declared=state.declared,
            version=state.version,
            enginectl_version=self._enginectl_version,
            incarnation=self._ledger.incarnation,
        )

    def _failed(self, step: str, err: GatewayError, attempt: int, retry_in_s: float) -> None:
        self._last_error = str(err)
        log.warning(
            "gateway_unreachable" if err.unreachable else "gateway_refused",
            gateway=self._workers.base_url,
            step=step,
            attempt=attempt,
            status=err.status,
            code=err.code or None,
            error=str(err),
            retry_in_s=round(retry_in_s, 2),
        )

    async def _sync(self) -> None:
        """Register until SMG holds the worker, then send every change of `_wanted`."""
        backoff = self._backoff()
        attempt = 0
        while True:
            try:
                if self._registered:
                    await self._send_or_check()
                else:
                    await self._register()
                backoff.reset()
                attempt = 0
            except GatewayError as err:
                attempt += 1
                delay = backoff.next()
                if err.not_found and self._registered:  # SMG lost the worker (restarted?)
                    log.warning("gateway_worker_lost", gateway=self._workers.base_url, worker_id=self._worker_id)
                    self._registered, self._worker_id, self._last_sent = False, None, None
                    continue
                self._failed("register" if not self._registered else "update", err, attempt, delay)
                await asyncio.sleep(delay)

    async def _register(self) -> None:
        began = time.monotonic()
        reg = self._registration(self._ledger.state)
        sent = version_labels(self._ledger.state.declared, self._ledger.state.version)
        self._posted = True
        self._worker_id = await self._call(self._workers.register, reg)
        await self._until_added(self._worker_id)
        self._registered, self._last_sent, self._last_error = True, sent, None
        log.info(
            "gateway_registered",
            gateway=self._workers.base_url,
            worker_id=self._worker_id,
            url=reg.url,
            control_url=reg.labels.get("rl.control_url"),
            weight_version=sent.version,
            unrepresentable=sent.unrepresentable,
            took_s=round(time.monotonic() - began, 3),
        )
        if sent != self._wanted:
            self._changed.set()

    async def _until_added(self, worker_id: str) -> None:
        """Wait while SMG is still adding the worker (it queries the engine first): a PATCH
        before then is accepted and lost. GatewayError when SMG dropped it."""
        delay = 0.02
        while True:
            row = await self._call(self._workers.get, worker_id)
            job = row.get("job_status") or {}
            if row.get("status") != "pending":
                return
            if job.get("status") == "failed":
                raise GatewayError("GET", f"/workers/{worker_id}", None, f"SMG could not add it: {job.get('message')}")
            await asyncio.sleep(delay)  # SMG offers no way to wait for its job
            delay = min(delay * 2, READY_POLL_MAX_S)

    async def _send_or_check(self) -> None:
        """Send `_wanted` once it differs from what SMG holds; with no change for a while, read
        the row back (a worker lost to a gateway restart, a PATCH SMG accepted but dropped)."""
        try:
            await asyncio.wait_for(self._changed.wait(), self._resync_interval_s)
        except asyncio.TimeoutError:
            assert self._worker_id is not None
            row = await self._call(self._workers.get, self._worker_id)
            held = (row.get("labels") or {}).get("weight_version")
            if held != self._wanted.version:
                self._last_sent = None
            else:
                return
        self._changed.clear()
        wanted, changed_at = self._wanted, self._wanted_at
        if wanted == self._last_sent:
            return
        assert self._worker_id is not None
        try:
            await self._call(self._workers.patch_labels, self._worker_id, wanted.labels())
        except GatewayError:
            self._changed.set()  # still to send, after the backoff
            raise
        self._last_sent, self._last_error = wanted, None
        log.info(
            "gateway_weight_version_sent",
            gateway=self._workers.base_url,
            worker_id=self._worker_id,
            weight_version=wanted.version,
            unrepresentable=wanted.unrepresentable,
            after_change_ms=round((time.monotonic() - changed_at) * 1e3, 1),
        )
