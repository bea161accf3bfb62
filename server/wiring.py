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
from enginectl.common.host import host_identity, is_loopback
from enginectl.contract.engine import QUICK_RPC_TIMEOUT_S, UNDECLARED_LABEL
from enginectl.contract.engine_config import EngineConfig, frame_key
from enginectl.server.census import Census, take_census
from enginectl.server.config import GatewayConfig, RolloutConfig, ServeConfig
from enginectl.server.fpm.identity import IdentitySync
from enginectl.server.fpm.identity_gate import IdentityGate
from enginectl.server.fpm.relay_zmq import FpmRelayHost
from enginectl.server.gateway import GatewayRegistration
from enginectl.server.grpc_server import ControlPlaneServer, service_names
from enginectl.server.health import ServingHealth
from enginectl.server.metrics import ControlPlaneMetrics, register_fpm_metrics
from enginectl.server.prompt_calls import PromptCalls
from enginectl.server.rank_watch import RankWatch
from enginectl.server.weights.sources.channels import ChannelSettings, DroppedFrames
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
    secret = secrets.token_hex(16)  # every frame of this start carries it (DESIGN §13)
    multinode = config.multinode
    fpm = FpmRelayHost(
        ring_size=config.fpm.ring_size,
        queue_limit=config.fpm.queue_limit,
        require_identity=config.identity.await_worker_id,
        defer_to=prompt_calls.any,
        key=frame_key(incarnation, secret),
        tcp_address=multinode.channel_address,
    )
    head = host_identity()
    engine_config = EngineConfig(
        fpm_endpoint=fpm.endpoint,
        worker_id=config.identity.worker_id,
        await_worker_id=config.identity.await_worker_id,
        heartbeat_interval_s=config.identity.heartbeat_interval_s,
        incarnation=incarnation,
        load_check=config.updates.load_check,
        fpm_tcp_endpoint=fpm.tcp_endpoint,
        head_hostname=head.hostname,
        head_boot_id=head.boot_id,
        channel_secret=secret,
        liveness_timeout_s=multinode.liveness_timeout_s,
    )
    return BeforeEngine(incarnation, prompt_calls, identity, fpm, engine_config)


async def configure_ranks(engine: EngineAdapter, census: Census, config: EngineConfig) -> None:
    """Hand every rank this start's EngineConfig (a rank on another node learns the relay's
    endpoint, the channel secret and the worker id only this way: DESIGN §13) and check that
    each now holds it; StartupError naming every rank that does not, or that another host
    could only reach on a loopback address. Nothing to hand an engine whose ranks run no
    enginectl scheduler (the census let it through: it publishes nothing)."""
    if not census.enginectl_schedulers():
        return
    remote = census.remote()
    problems: list[str] = []
    if remote and config.fpm_tcp_endpoint and _loopback(config.fpm_tcp_endpoint):
        problems.extend(
            f"rank {rank} (host {host}): this head listens for it on {config.fpm_tcp_endpoint}, a loopback "
            "address; set --channel-address (or --data-parallel-address) to one that host can reach"
            for rank, host in sorted(remote.items())
        )
    elif remote and not config.fpm_tcp_endpoint:
        problems.extend(
            f"rank {rank} (host {host}) runs on another host, but this head expects every rank on its own "
            "(--data-parallel-size-local equals --data-parallel-size)"
            for rank, host in sorted(remote.items())
        )
    if not problems:
        expected = config.digest()
        for outcome in await engine.configure(config, QUICK_RPC_TIMEOUT_S):
            if outcome.result is None:
                problems.append(f"rank {outcome.dp_rank}: CONFIGURE failed ({outcome.message})")
            elif outcome.result.digest != expected:
                problems.append(f"rank {outcome.dp_rank}: holds config {outcome.result.digest}, sent {expected}")
            else:
                log.info("rank configured", dp_rank=outcome.dp_rank, fpm_endpoint=outcome.result.fpm_endpoint)
    if problems:
        raise StartupError(f"the engine's ranks can not all be reached, so it will not serve: {'; '.join(problems)}")


def _loopback(endpoint: str) -> bool:
    """Whether a tcp:// endpoint's host is a loopback address."""
    return is_loopback(endpoint.removeprefix("tcp://").rsplit(":", 1)[0])


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
    census = await take_census(engine, enginectl.__version__)  # before anything else asks the ranks
    refusal = census.refusal()
    if refusal is not None:
        raise StartupError(f"the engine's ranks disagree, so it will not serve: {refusal}")
    await configure_ranks(engine, census, before.engine_config)
    await engine.set_weight_version(UNDECLARED_LABEL)  # not vLLM's "default", which can be declared
    expected = await asyncio.to_thread(checkpoint_tensors, engine.info.model)
    metrics = ControlPlaneMetrics(ledger)
    health = ServingHealth(service_names(rollouts))
    update_frames = DroppedFrames()
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
        channels=ChannelSettings(
            key=before.engine_config.frame_key(),
            remote_ranks=frozenset(census.remote()),
            tcp_address=config.multinode.channel_address,
        ),
        dropped_frames=update_frames,
        remote_ranks=census.remote(),
    )
    await updates.prepare()  # milliseconds
    transfer = WeightTransfer(engine, updates, config.weight_transfer_backend, on_takeover=metrics.taken_over)
    relay = before.fpm.start(ledger)
    register_fpm_metrics(relay, update_frames)  # once per process: the counters on vLLM's /metrics
    rank_watch = RankWatch(
        relay, census.remote(), bound_s=config.multinode.liveness_timeout_s, lost=engine.rank_lost
    ).start()
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
        rank_watch=rank_watch,
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
