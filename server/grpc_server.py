"""ControlPlaneServer: the grpc.aio server with every enginectl service, health and reflection.

Runs in the `enginectl serve` process, on the control loop (control_loop.py), not on the loop
vLLM's HTTP server and AsyncLLM share. It registers each servicer once, explicitly, and gives
the interceptor the RPCs this server does not serve: UNIMPLEMENTED NOT_IMPLEMENTED before any
servicer runs, the one place "no engine" is refused. Its collaborators are built beforehand,
in dependency order, by server/wiring.py (tests build it with only a ledger: no engine).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health_pb2_grpc

from enginectl.fpm.v1 import (
    forward_pass_metrics_service_pb2,
    forward_pass_metrics_service_pb2_grpc,
    fpm_identity_service_pb2,
    fpm_identity_service_pb2_grpc,
)
from enginectl.server import limits
from enginectl.server.census import Census
from enginectl.server.config import TlsConfig
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.fpm.relay import FpmRelay
from enginectl.server.fpm.services import ForwardPassMetricsServicer, FpmIdentityServicer
from enginectl.server.fpm.services import stream as fpm_stream
from enginectl.server.health import SERVICE_NAME as HEALTH_SERVICE
from enginectl.server.health import ServingHealth
from enginectl.server.interceptors import BearerToken, RpcInterceptor
from enginectl.server.limits import MAX_MESSAGE_BYTES
from enginectl.server.local_endpoint import LocalEndpoint
from enginectl.server.prompt_calls import PromptCalls
from enginectl.server.rank_watch import RankWatch
from enginectl.server.reflection import enable_reflection
from enginectl.server.weights.services import OperationsServicer, WeightUpdateServicer, WeightVersionServicer
from enginectl.server.weights.transfer import WeightTransfer
from enginectl.server.weights.update.operations import OperationStore
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import (
    weight_update_service_pb2,
    weight_update_service_pb2_grpc,
    weight_version_service_pb2,
    weight_version_service_pb2_grpc,
)

if TYPE_CHECKING:
    from enginectl.server.engine_info import EngineInfo
    from enginectl.server.fpm.identity import IdentitySync
    from enginectl.server.metrics import ControlPlaneMetrics
    from enginectl.server.rollouts import RolloutService
    from enginectl.server.weights.updates import WeightUpdates

WEIGHT_VERSION = weight_version_service_pb2.DESCRIPTOR.services_by_name["WeightVersionService"]
WEIGHT_UPDATE = weight_update_service_pb2.DESCRIPTOR.services_by_name["WeightUpdateService"]
FPM_IDENTITY = fpm_identity_service_pb2.DESCRIPTOR.services_by_name["FpmIdentityService"]
FPM_STREAM = forward_pass_metrics_service_pb2.DESCRIPTOR.services_by_name["ForwardPassMetricsService"]
OPERATIONS = operations_pb2.DESCRIPTOR.services_by_name["Operations"]
SERVICES = (WEIGHT_VERSION, WEIGHT_UPDATE, FPM_IDENTITY, FPM_STREAM, OPERATIONS)


def _every(service: _descriptor.ServiceDescriptor) -> list[str]:
    """Full names ("pkg.Service/Method") of every RPC of `service`."""
    return [f"{service.full_name}/{m.name}" for m in service.methods]


# What a server without an engine (no WeightUpdates: tests build one) still answers: the
# version resource lives in the ledger alone, GetServerInfo describes the server, and
# operations and the metrics stream need no engine either.
ENGINE_FREE = frozenset(
    {
        f"{WEIGHT_VERSION.full_name}/GetWeightVersion",
        f"{WEIGHT_VERSION.full_name}/SetWeightVersion",
        f"{WEIGHT_VERSION.full_name}/WatchWeightVersion",
        f"{WEIGHT_UPDATE.full_name}/GetServerInfo",
        *_every(FPM_STREAM),
        *_every(OPERATIONS),
    }
)


def service_names(rollouts: RolloutService | None = None) -> tuple[str, ...]:
    """Full names of the services a ControlPlaneServer serves (health's and reflection's aside)."""
    return (*(service.full_name for service in SERVICES), *((rollouts.name,) if rollouts is not None else ()))


def _implemented(servicer: type, generated: type, service: _descriptor.ServiceDescriptor) -> list[str]:
    """Full names ("pkg.Service/Method") of the RPCs of `service` that `servicer` (the
    `generated` servicer or a subclass) defines."""
    return [
        f"{service.full_name}/{m.name}"
        for m in service.methods
        if getattr(servicer, m.name) is not getattr(generated, m.name)
    ]


def _not_implemented(rpcs: Iterable[str], why: str) -> dict[str, ControlPlaneError]:
    """The interceptor's answer to each of `rpcs` ("pkg.Service/Method"): UNIMPLEMENTED."""
    return {
        f"/{rpc}": ControlPlaneError(
            grpc.StatusCode.UNIMPLEMENTED, Reason.NOT_IMPLEMENTED, f"{rpc} is not implemented by this server ({why})"
        )
        for rpc in rpcs
    }


class ControlPlaneServer:
    """Owns the gRPC server and the services registered on it; `health` says whether it serves."""

    def __init__(
        self,
        ledger: WeightVersionLedger,
        *,
        engine_info: EngineInfo | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        log_reads: bool = False,
        metrics: ControlPlaneMetrics | None = None,
        fpm_relay: FpmRelay | None = None,
        identity: IdentitySync | None = None,
        updates: WeightUpdates | None = None,
        transfer: WeightTransfer | None = None,
        operations: OperationStore | None = None,
        rollouts: RolloutService | None = None,
        health: ServingHealth | None = None,
        prompt_calls: PromptCalls | None = None,
        census: Census | None = None,
        rank_watch: RankWatch | None = None,
    ) -> None:
        self.ledger = ledger
        self._census = census
        self._rank_watch = rank_watch
        self.updates = updates
        self.operations = operations or OperationStore()
        # Without a relay (no engine behind this server) streams carry only progress messages.
        self.fpm_relay = fpm_relay or FpmRelay(incarnation=ledger.incarnation)
        self.service_names = list(service_names(rollouts))
        self.health = health or ServingHealth(self.service_names)
        self._tls = tls
        self._engine_dead = False

        # The RPCs served are those each servicer defines (GetServerInfo's supported_rpcs), but
        # for the engine-free ones only without an engine (no WeightUpdates). The interceptor
        # answers the rest UNIMPLEMENTED NOT_IMPLEMENTED before any servicer is reached.
        # Without an IdentitySync, the generated servicer: it defines none of the RPCs (its
        # stub marks them abstract; at run time they exist, and are never reached).
        identity_servicer = (
            FpmIdentityServicer(identity)
            if identity is not None
            else fpm_identity_service_pb2_grpc.FpmIdentityServiceServicer()  # type: ignore[abstract]
        )
        served = {
            WEIGHT_VERSION: _implemented(
                WeightVersionServicer, weight_version_service_pb2_grpc.WeightVersionServiceServicer, WEIGHT_VERSION
            ),
            WEIGHT_UPDATE: _implemented(
                WeightUpdateServicer, weight_update_service_pb2_grpc.WeightUpdateServiceServicer, WEIGHT_UPDATE
            ),
            FPM_IDENTITY: _implemented(
                type(identity_servicer), fpm_identity_service_pb2_grpc.FpmIdentityServiceServicer, FPM_IDENTITY
            ),
            FPM_STREAM: _implemented(
                ForwardPassMetricsServicer,
                forward_pass_metrics_service_pb2_grpc.ForwardPassMetricsServiceServicer,
                FPM_STREAM,
            ),
            OPERATIONS: _implemented(OperationsServicer, operations_pb2_grpc.OperationsServicer, OPERATIONS),
        }
        self.supported_rpcs = [rpc for rpcs in served.values() for rpc in rpcs]
        refused = _not_implemented(
            (rpc for service in SERVICES for rpc in _every(service) if rpc not in served[service]),
            "not in this release",
        )
        if updates is None:
            every = (rpc for service in SERVICES for rpc in _every(service))
            refused.update(_not_implemented((rpc for rpc in every if rpc not in ENGINE_FREE), "it has no engine"))
        if rollouts is not None:  # vLLM's VllmEngine (server/rollouts.py): rollouts on this port
            self.supported_rpcs.extend(rollouts.rpcs)

        self._interceptor = RpcInterceptor(
            token=BearerToken(token) if token else None,
            log_reads=log_reads,
            on_done=metrics.rpc_done if metrics else None,
            open_methods=rollouts.open_methods if rollouts else frozenset(),
            guarded_methods=rollouts.guarded_methods if rollouts else frozenset(),
            not_served=refused,
            prompt_calls=prompt_calls,
        )
        self._server = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # Watch streams are long and quiet; allow client keepalives between messages.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        # Every servicer is registered through the local endpoint, which hands it on to the
        # server: the HTTP routes call the same handlers in process (server/local_endpoint.py).
        self.local = LocalEndpoint(self._server, self._interceptor)
        server: Any = self.local
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        weight_version_service_pb2_grpc.add_WeightVersionServiceServicer_to_server(
            WeightVersionServicer(ledger, updates), server
        )
        weight_update_service_pb2_grpc.add_WeightUpdateServiceServicer_to_server(
            WeightUpdateServicer(self._server_info(engine_info, token is not None), updates, transfer), server
        )
        fpm_identity_service_pb2_grpc.add_FpmIdentityServiceServicer_to_server(identity_servicer, server)
        fpm_stream.add_to_server(ForwardPassMetricsServicer(self.fpm_relay), server)
        operations_pb2_grpc.add_OperationsServicer_to_server(OperationsServicer(self.operations), server)
        if rollouts is not None:
            state = self.updates.generation_state if self.updates is not None else None
            rollouts.add_to_server(server, ledger, self.health.unhealthy, state)
        enable_reflection((*self.service_names, HEALTH_SERVICE), server)

    def _server_info(self, engine: EngineInfo | None, auth: bool) -> weight_update_service_pb2.GetServerInfoResponse:
        """The GetServerInfo answer: fixed for the life of this server."""
        import enginectl

        info = weight_update_service_pb2.GetServerInfoResponse(
            auth_required=auth,
            enginectl_version=enginectl.__version__,
            api_versions=sorted({name.rsplit(".", 1)[0] for name in self.service_names}),
            supported_rpcs=self.supported_rpcs,
            incarnation=self.ledger.incarnation,
            limits=self._limits(),
        )
        info.start_time.GetCurrentTime()
        if self.updates is not None:
            info.backends.extend(self.updates.backends())
            info.fingerprint_method = self.updates.fingerprint_method
            info.full_fingerprint_method = self.updates.full_fingerprint_method
            info.allowed_weight_roots.extend(str(root) for root in self.updates.allowed_roots)
            info.staging.CopyFrom(self.updates.staging.info())
        if engine is not None:
            info.model = engine.model
            info.served_model_names.extend(engine.served_model_names)
            dtype = f"TENSOR_DTYPE_{engine.dtype.upper()}"
            if dtype in weight_update_service_pb2.TensorDtype.keys():
                info.dtype = weight_update_service_pb2.TensorDtype.Value(dtype)
            info.quantization = engine.quantization
            info.data_parallel_size = engine.data_parallel_size
            info.tensor_parallel_size = engine.tensor_parallel_size
            info.pipeline_parallel_size = engine.pipeline_parallel_size
            info.num_workers = engine.num_workers
            info.managed_ranks.start = engine.managed_ranks.start
            info.managed_ranks.count = len(engine.managed_ranks)
            info.engine_id = engine.engine_id or self.ledger.incarnation
            info.vllm_version = engine.vllm_version
        if self._census is not None:
            info.ranks.extend(self._census.ranks())
        return info

    @staticmethod
    def _limits() -> weight_update_service_pb2.ServerLimits:
        """ServerLimits, from the bounds table (server/limits.py)."""
        answer = weight_update_service_pb2.ServerLimits(
            max_version_bytes=limits.MAX_VERSION_BYTES,
            max_request_bytes=limits.MAX_MESSAGE_BYTES,
            max_path_bytes=limits.MAX_PATH_BYTES,
            max_group_name_bytes=limits.MAX_GROUP_NAME_BYTES,
            max_tensor_name_bytes=limits.MAX_TENSOR_NAME_BYTES,
            max_tensors_per_update=limits.MAX_TENSORS,
            max_shape_rank=limits.MAX_SHAPE_RANK,
            max_tensor_elements=limits.MAX_TENSOR_ELEMENTS,
            max_chunk_bytes=limits.MAX_CHUNK_BYTES,
            max_update_groups=limits.MAX_GROUPS,
            max_retained_operations=limits.MAX_RETAINED,
        )
        answer.default_timeout.FromSeconds(int(limits.DEFAULT_TIMEOUT_S))
        answer.max_timeout.FromSeconds(int(limits.MAX_TIMEOUT_S))
        return answer

    async def start(self, host: str, port: int) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._tls is not None:
            bound = self._server.add_secure_port(address, self._tls.credentials())
        else:
            bound = self._server.add_insecure_port(address)
        await self._server.start()
        return bound

    async def set_serving(self, serving: bool) -> None:
        """Health of the whole server ("") and of every service: SERVING once the server is
        up, unless quarantined; once the engine died it stays NOT_SERVING (ServingHealth)."""
        await self.health.set_serving(serving)

    async def engine_dead(self, cause: str) -> None:
        """The engine died: from now on every RPC but health and reflection answers UNAVAILABLE
        ENGINE_DEAD (reads too: the weights a version described are gone), open Watch and FPM
        streams end with that reason, and health is NOT_SERVING for good. Idempotent; the
        process then shuts down (`stop`)."""
        if self._engine_dead:
            return
        self._engine_dead = True
        if self._rank_watch is not None:
            self._rank_watch.stop()
        message = f"the engine died ({cause}); this server is shutting down"
        # Synchronous up to the health flip: nothing runs between refusing and ending streams.
        self._interceptor.refuse(ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD, message))
        self.ledger.close(Reason.ENGINE_DEAD, message)
        self.fpm_relay.close(Reason.ENGINE_DEAD, message)
        self.operations.close(Reason.ENGINE_DEAD, message)
        await self.health.engine_died()

    async def stop(self, grace: float) -> None:
        """Graceful stop: NOT_SERVING first, streams end with UNAVAILABLE, then the server.
        From now on new calls, the local endpoint's too (the HTTP routes, which outlive the
        gRPC server by a few seconds), answer UNAVAILABLE SHUTTING_DOWN."""
        if not self._engine_dead:
            self._interceptor.refuse(
                ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.SHUTTING_DOWN, "server is shutting down")
            )
        await self.health.stopping()
        if self._rank_watch is not None:
            self._rank_watch.stop()
        self.ledger.close()
        self.fpm_relay.close()
        self.operations.close()  # calls waiting on an update end UNAVAILABLE SHUTTING_DOWN
        if self.updates is not None:
            self.updates.close()
        await self._server.stop(grace)
