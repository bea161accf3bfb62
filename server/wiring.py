"""The control plane's objects of one `enginectl serve`, each built once, in dependency order.

Runs in the `enginectl serve` process. Every collaborator and callback is handed to the
constructor that needs it; nothing is reached into afterwards. Four steps, as serve.py runs
them (server/flags.py has already turned the flags into a ServeConfig, server/config.py):

- `before_engine`, on the main loop before the engine starts: the server's incarnation, the
  prompt-call counter (shared by the RPC interceptor, which counts, and the FPM relay's
  intake, which defers), the identity gate and the relay's socket, whose endpoint goes into
  the EngineConfig every EngineCore is handed;
- `rollout_service`, on the main loop once the engine is up: vLLM's gRPC engine service over
  it, unless turned off or not installed;
- `start_control_plane`, on the control loop: fingerprints, ledger, operations, metrics,
  health, weight updates, relay, identity sync, then the gRPC server, bound and started;
- `start_gateway`, on the control loop once serving: with --gateway, the registration with
  the SMG gateway, which then follows the ledger in the background.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

import enginectl
from enginectl.common.gateway import SmgWorkers
from enginectl.contract.engine import UNDECLARED_LABEL
from enginectl.contract.engine_config import EngineConfig
from enginectl.server.census import take_census
from enginectl.server.config import GatewayConfig, RolloutConfig, ServeConfig
from enginectl.server.fpm.identity import IdentitySync
from enginectl.server.fpm.identity_gate import IdentityGate
from enginectl.server.fpm.relay_zmq import FpmRelayHost
from enginectl.server.gateway import GatewayRegistration
from enginectl.server.grpc_server import ControlPlaneServer, service_names
from enginectl.server.health import ServingHealth
from enginectl.server.metrics import ControlPlaneMetrics, register_fpm_metrics
from enginectl.server.prompt_calls import PromptCalls
from enginectl.server.weights.sources.disk import checkpoint_tensors
from enginectl.server.weights.transfer import WeightTransfer
from enginectl.server.weights.update.operations import OperationStore
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.fingerprints import WeightFingerprints
from enginectl.server.weights.version.ledger import WeightVersionLedger

if TYPE_CHECKING:
    from enginectl.server.engine import EngineAdapter
    from enginectl.server.http.route_calls import RouteCalls
    from enginectl.server.rollouts import RolloutService

log = structlog.get_logger("enginectl.serve")


class StartupError(Exception):
    """Serving cannot start (e.g. the gRPC port is taken); the process exits non-zero."""


@dataclass(frozen=True)
class BeforeEngine:
    """What is built before the engine starts (see `before_engine`)."""

    incarnation: str  # the server's, handed to every EngineCore and the ledger
    prompt_calls: PromptCalls
    identity: IdentityGate
    fpm: FpmRelayHost
    engine_config: EngineConfig  # what every EngineCore of this start is handed


def before_engine(config: ServeConfig, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> BeforeEngine:
    """Build what the EngineCores must know of before they start; on the main loop."""
    incarnation = secrets.token_hex(8)
    prompt_calls = PromptCalls()
    identity = IdentityGate(
        await_worker_id=config.identity.await_worker_id,
        exit_on_failure=config.identity.exit_on_failure,
        loop=loop,
        stop=stop,
    )
    fpm = FpmRelayHost(
        ring_size=config.fpm.ring_size,
        queue_limit=config.fpm.queue_limit,
        require_identity=config.identity.await_worker_id,
        defer_to=prompt_calls.any,
    )
    engine_config = EngineConfig(
        fpm_endpoint=fpm.endpoint,
        worker_id=config.identity.worker_id,
        await_worker_id=config.identity.await_worker_id,
        heartbeat_interval_s=config.identity.heartbeat_interval_s,
        incarnation=incarnation,
        load_check=config.updates.load_check,
    )
    return BeforeEngine(incarnation, prompt_calls, identity, fpm, engine_config)


def rollout_service(
    config: RolloutConfig, engine: EngineAdapter, loop: asyncio.AbstractEventLoop
) -> RolloutService | None:
    """vLLM's gRPC engine service over this engine, unless turned off or not installed; on the
    engine's loop (`loop`), where it runs."""
    from enginectl.server.rollouts import RolloutService, available

    if not config.enabled:
        return None
    if not available():
        log.warning(
            "grpc_rollouts_off", reason="smg-grpc-servicer is not installed", fix="pip install smg-grpc-servicer"
        )
        return None
    return RolloutService(engine.client, loop, log_requests=config.log_requests, guard_all=config.token_guards)


async def start_control_plane(
    engine: EngineAdapter, config: ServeConfig, before: BeforeEngine, rollouts: RolloutService | None
) -> tuple[ControlPlaneServer, int]:
    """Build and start the gRPC server and everything behind it; runs on the control loop,
    which then owns them. Returns the server and its bound port."""
    fingerprints = WeightFingerprints(engine)
    ledger = WeightVersionLedger(
        publish=engine.set_weight_version, fingerprint=fingerprints.declaration, incarnation=before.incarnation
    )
    operations = OperationStore()
    await engine.set_weight_version(UNDECLARED_LABEL)  # not vLLM's "default", which can be declared
    expected = await asyncio.to_thread(checkpoint_tensors, engine.info.model)
    metrics = ControlPlaneMetrics(ledger)
    health = ServingHealth(service_names(rollouts))
    updates = WeightUpdates(
        engine,
        ledger,
        operations,
        allowed_roots=config.updates.allowed_roots(engine.info.model),
        expected=expected,
        on_finished=metrics.update_done,
        on_pause=metrics.pause_changed,
        max_staged_bytes=config.updates.max_staged_bytes,
        staged_ttl=config.updates.staged_ttl,
        on_staged_bytes=metrics.set_staged_bytes,
        fingerprints=fingerprints,
        on_partial=health.set_quarantined,
        on_takeover=metrics.taken_over,
    )
    census = await take_census(engine, enginectl.__version__)  # before anything else asks the ranks
    refusal = census.refusal()
    if refusal is not None:
        raise StartupError(f"the engine's ranks disagree, so it will not serve: {refusal}")
    await updates.prepare()  # milliseconds
    transfer = WeightTransfer(engine, updates, config.weight_transfer_backend, on_takeover=metrics.taken_over)
    relay = before.fpm.start(ledger)
    register_fpm_metrics(relay)  # once per process: the relay's counters on vLLM's /metrics
    identity = IdentitySync(
        engine,
        await_worker_id=config.identity.await_worker_id,
        on_outcome=before.identity.outcome,
        on_synced=metrics.identity_synced,
    )
    plane = ControlPlaneServer(
        ledger,
        engine_info=engine.info,
        token=config.grpc.token,
        tls=config.grpc.tls,
        log_reads=config.grpc.log_reads,
        metrics=metrics,
        fpm_relay=relay,
        identity=identity,
        updates=updates,
        transfer=transfer,
        operations=operations,
        rollouts=rollouts,
        health=health,
        prompt_calls=before.prompt_calls,
        census=census,
    )
    await plane.set_serving(False)  # SERVING only once HTTP is up (and, if awaited, the identity)
    host, port = config.grpc.host, config.grpc.port
    try:
        bound = await plane.start(host, port)
    except RuntimeError as exc:  # grpcio raises when the port is taken
        raise StartupError(f"could not bind gRPC to {host}:{port}: {exc}") from None
    if bound == 0:
        raise StartupError(f"could not bind gRPC to {host}:{port}")
    return plane, bound


async def start_gateway(
    config: GatewayConfig | None, ledger: WeightVersionLedger, *, token: str | None, grpc_port: int, http_port: int
) -> GatewayRegistration | None:
    """With --gateway, register with SMG in the background and follow `ledger`; on the control
    loop, which then owns the registration (serve.py stops it before the control plane).
    `token` is the server's own (SMG's `api_key` for this worker)."""
    if config is None:
        return None
    registration = GatewayRegistration(
        SmgWorkers(config.url, config.token),
        ledger,
        host=config.advertise_host,
        grpc_port=grpc_port,
        http_port=http_port,
        token=token,
        enginectl_version=enginectl.__version__,
    )
    registration.start()
    log.info("gateway_registering", gateway=config.url, url=registration.url)
    return registration


def http_routes(config: ServeConfig, plane: ControlPlaneServer, control_loop: asyncio.AbstractEventLoop) -> RouteCalls:
    """What the HTTP RL routes call through: `plane`'s RPCs (started) as typed calls run on
    `control_loop`; built on the main loop, where the routes run. Without a token, a server
    whose gRPC callers prove themselves with client certificates refuses every HTTP route that
    changes state: HTTP carries no such proof."""
    from enginectl.server.http.route_calls import RouteCalls
    from enginectl.server.local_plane import LocalPlane

    tls = config.grpc.tls
    refusal = None
    if config.grpc.token is None and tls is not None and tls.client_ca is not None:
        refusal = "this server authenticates control calls by client certificate; HTTP routes that change state need a token (--token-file)"
    return RouteCalls(LocalPlane(plane.local, control_loop), refusal=refusal)
