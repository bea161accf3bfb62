"""ControlPlaneServer: the grpc.aio server with every enginectl service, health and reflection.

Runs in the `enginectl serve` process, on the control loop (control_loop.py), not on the loop
vLLM's HTTP server and AsyncLLM share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from enginectl.fpm.v1 import (
    forward_pass_metrics_service_pb2,
    forward_pass_metrics_service_pb2_grpc,
    fpm_identity_service_pb2,
    fpm_identity_service_pb2_grpc,
)
from enginectl.server import limits
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.fpm.identity_service import FpmIdentityServicer
from enginectl.server.fpm.relay import FpmRelay
from enginectl.server.fpm.stream import ForwardPassMetricsServicer
from enginectl.server.interceptors import BearerToken, RpcInterceptor
from enginectl.server.limits import MAX_MESSAGE_BYTES
from enginectl.server.reflection import enable_reflection
from enginectl.server.weights.ledger import WeightVersionLedger
from enginectl.server.weights.operations import OperationStore
from enginectl.server.weights.services import OperationsServicer, WeightUpdateServicer, WeightVersionServicer
from enginectl.weights.v1 import (
    weight_update_service_pb2,
    weight_update_service_pb2_grpc,
    weight_version_service_pb2,
    weight_version_service_pb2_grpc,
)

if TYPE_CHECKING:
    from enginectl.server.engine import EngineInfo
    from enginectl.server.fpm.identity import IdentitySync
    from enginectl.server.metrics import ControlPlaneMetrics
    from enginectl.server.rollouts import RolloutService
    from enginectl.server.weights.updates import WeightUpdates


@dataclass(frozen=True)
class TlsConfig:
    """Server TLS; with `client_ca` set, clients must present a certificate it signed (mTLS)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _with_unimplemented(
    impl: type, generated: type, service: _descriptor.ServiceDescriptor, arrives: str
) -> tuple[type, list[str]]:
    """`impl` (a subclass of the `generated` servicer, or that class itself) completed so
    every RPC it does not override answers UNIMPLEMENTED with a clear message.

    Returns the class and the full names ("pkg.Service/Method") of the RPCs `impl` defines.
    """

    def make(name: str, streaming: bool) -> Any:
        def error() -> ControlPlaneError:
            return ControlPlaneError(
                grpc.StatusCode.UNIMPLEMENTED,
                Reason.NOT_IMPLEMENTED,
                f"{service.full_name}/{name} is not implemented in this release ({arrives})",
            )

        if streaming:

            async def stream(self: Any, request: Any, context: Any) -> Any:
                raise error()
                yield  # pragma: no cover - makes this an async generator

            return stream

        async def unary(self: Any, request: Any, context: Any) -> Any:
            raise error()

        return unary

    implemented = [m.name for m in service.methods if getattr(impl, m.name) is not getattr(generated, m.name)]
    missing = {m.name: make(m.name, m.server_streaming) for m in service.methods if m.name not in implemented}
    return type(impl.__name__, (impl,), missing), [f"{service.full_name}/{m}" for m in implemented]


class ControlPlaneServer:
    """Owns the gRPC server, its health states and the services registered on it."""

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
        operations: OperationStore | None = None,
        rollouts: RolloutService | None = None,
        token_guards_rollouts: bool = False,
    ) -> None:
        self.ledger = ledger
        self.updates = updates
        self.operations = operations or OperationStore()
        # Without a relay (no engine behind this server) streams carry only progress messages.
        self.fpm_relay = fpm_relay or FpmRelay(incarnation=ledger.incarnation)
        self._tls = tls
        self._engine_dead = False
        self._serving = False  # set_serving(True) was called (the server is up)
        self._quarantined = False  # an update failed part-way: the weights may be mixed
        self._stopping = False  # stop() began
        if updates is not None:
            updates.generation.on_partial = self.set_quarantined
        self._interceptor = interceptor = RpcInterceptor(
            token=BearerToken(token) if token else None,
            log_reads=log_reads,
            on_done=metrics.rpc_done if metrics else None,
            open_methods=rollouts.open(token_guards_rollouts) if rollouts else frozenset(),
            guarded_methods=rollouts.guarded(token_guards_rollouts) if rollouts else frozenset(),
        )
        # The FPM relay's intake shares this loop: it takes smaller bites while a prompt call runs.
        self.fpm_relay.defer_to = lambda: interceptor.prompt_calls > 0
        self._server = grpc.aio.server(
            interceptors=[interceptor],
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # Watch streams are long and quiet; allow client keepalives between messages.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

        # (pb2, pb2_grpc, service, servicer class or None, what its missing RPCs wait for)
        services: list[tuple[Any, Any, str, Any, str]] = [
            (
                weight_version_service_pb2,
                weight_version_service_pb2_grpc,
                "WeightVersionService",
                WeightVersionServicer,
                "not implemented by this server",
            ),
            (
                weight_update_service_pb2,
                weight_update_service_pb2_grpc,
                "WeightUpdateService",
                WeightUpdateServicer,
                "not implemented by this server",
            ),
            (
                fpm_identity_service_pb2,
                fpm_identity_service_pb2_grpc,
                "FpmIdentityService",
                FpmIdentityServicer if identity is not None else None,
                "this server has no engine",
            ),
            (
                forward_pass_metrics_service_pb2,
                forward_pass_metrics_service_pb2_grpc,
                "ForwardPassMetricsService",
                ForwardPassMetricsServicer,
                "",
            ),
            (operations_pb2, operations_pb2_grpc, "Operations", OperationsServicer, ""),
        ]
        self.service_names: list[str] = []
        self.supported_rpcs: list[str] = []
        completed: list[tuple[str, Any, type]] = []
        for pb2, pb2_grpc, name, impl, arrives in services:
            descriptor = pb2.DESCRIPTOR.services_by_name[name]
            generated = getattr(pb2_grpc, f"{name}Servicer")
            cls, implemented = _with_unimplemented(impl or generated, generated, descriptor, arrives)
            add = getattr(impl, "add_to_server", None) or getattr(pb2_grpc, f"add_{name}Servicer_to_server")
            completed.append((name, add, cls))
            self.service_names.append(descriptor.full_name)
            self.supported_rpcs.extend(implemented)
        if rollouts is not None:  # vLLM's VllmEngine (server/rollouts.py): rollouts on this port
            self.service_names.append(rollouts.name)
            self.supported_rpcs.extend(rollouts.rpcs)
        # Constructor arguments, once supported_rpcs (part of GetServerInfo) is known.
        arguments: dict[str, tuple[Any, ...]] = {
            "WeightVersionService": (ledger, updates),
            "WeightUpdateService": (self._server_info(engine_info, token is not None), updates),
            "Operations": (self.operations,),
            "ForwardPassMetricsService": (self.fpm_relay,),
        }
        if identity is not None:
            arguments["FpmIdentityService"] = (identity,)
        for name, add, cls in completed:
            add(cls(*arguments.get(name, ())), self._server)
        if rollouts is not None:
            rollouts.add_to_server(self._server, ledger, self.unhealthy)
        enable_reflection((*self.service_names, health.SERVICE_NAME), self._server)

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
            info.vllm_version = engine.vllm_version
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
        """Health of the whole server ("") and of every enginectl service: SERVING once the
        server is up, unless quarantined; once the engine died it stays NOT_SERVING."""
        self._serving = serving
        await self._apply_health()

    async def set_quarantined(self, quarantined: bool) -> None:
        """An update failed part-way (or the engine holds its mixed weights again): NOT_SERVING
        so routers, gateways and readiness probes take this server out, until an update
        succeeds. A forced resume lets generation run but keeps the quarantine
        (docs/operations.md, "Quarantine")."""
        self._quarantined = quarantined
        await self._apply_health()

    def unhealthy(self) -> str:
        """Why this server is NOT_SERVING ("" while SERVING): what vLLM's VllmEngine/HealthCheck
        reports too, since gateways (SMG) ask only that (server/rollouts.py)."""
        if self._engine_dead:
            return "the engine died"
        if self._stopping:
            return "the server is shutting down"
        if self._quarantined:
            return "quarantined: the last update failed part-way and the weights may be mixed"
        if not self._serving:
            return "not serving yet (starting, or awaiting its worker identity)"
        return ""

    async def _apply_health(self) -> None:
        serving = not self.unhealthy()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def engine_dead(self, cause: str) -> None:
        """The engine died: from now on every RPC but health and reflection answers UNAVAILABLE
        ENGINE_DEAD (reads too: the weights a version described are gone), open Watch and FPM
        streams end with that reason, and health is NOT_SERVING for good. Idempotent; the
        process then shuts down (`stop`)."""
        if self._engine_dead:
            return
        self._engine_dead = True
        message = f"the engine died ({cause}); this server is shutting down"
        # Synchronous up to the health flip: nothing runs between refusing and ending streams.
        self._interceptor.refuse(ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD, message))
        self.ledger.close(Reason.ENGINE_DEAD, message)
        self.fpm_relay.close(Reason.ENGINE_DEAD, message)
        self.operations.close(Reason.ENGINE_DEAD, message)
        await self.set_serving(False)

    async def stop(self, grace: float) -> None:
        """Graceful stop: NOT_SERVING first, streams end with UNAVAILABLE, then the server."""
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        self.ledger.close()
        self.fpm_relay.close()
        self.operations.close()  # calls waiting on an update end UNAVAILABLE SHUTTING_DOWN
        if self.updates is not None:
            self.updates.close()
        await self._server.stop(grace)
