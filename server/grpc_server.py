"""ControlPlaneServer: the grpc.aio server with every enginectl service, health and reflection.

Runs in the `enginectl serve` process, on the same event loop as vLLM's HTTP server and the
AsyncLLM they share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from enginectl.fpm.v1 import (
    forward_pass_metrics_service_pb2,
    forward_pass_metrics_service_pb2_grpc,
    fpm_identity_service_pb2,
    fpm_identity_service_pb2_grpc,
)
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.interceptors import BearerTokenInterceptor, RpcLogInterceptor
from enginectl.server.ledger import WeightVersionLedger
from enginectl.server.weight_version_service import WeightVersionServicer
from enginectl.weights.v1 import (
    weight_update_service_pb2,
    weight_update_service_pb2_grpc,
    weight_version_service_pb2,
    weight_version_service_pb2_grpc,
)

log = structlog.get_logger("enginectl.server")

# Generous for weight-update chunks and tensor manifests; every field is bounded anyway.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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


def _unimplemented_servicer(base: type, service: _descriptor.ServiceDescriptor, arrives: str) -> Any:
    """An instance of `base` whose every RPC answers UNIMPLEMENTED with a clear message."""

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

    methods = {m.name: make(m.name, m.server_streaming) for m in service.methods}
    return type(f"Unimplemented{service.name}", (base,), methods)()


class ControlPlaneServer:
    """Owns the gRPC server, its health states and the services registered on it."""

    def __init__(
        self,
        ledger: WeightVersionLedger,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.ledger = ledger
        self._tls = tls
        interceptors: list[grpc.aio.ServerInterceptor] = [RpcLogInterceptor()]
        if token:
            interceptors.insert(0, BearerTokenInterceptor(token))
        self._server = grpc.aio.server(
            interceptors=interceptors,
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

        weight_version_service_pb2_grpc.add_WeightVersionServiceServicer_to_server(
            WeightVersionServicer(ledger), self._server
        )
        services = {
            "WeightVersionService": weight_version_service_pb2.DESCRIPTOR.services_by_name[
                "WeightVersionService"
            ]
        }
        pending: Sequence[tuple[Any, Any, Any, str]] = (
            (
                weight_update_service_pb2,
                weight_update_service_pb2_grpc,
                "WeightUpdateService",
                "weight updates arrive in a later release",
            ),
            (
                fpm_identity_service_pb2,
                fpm_identity_service_pb2_grpc,
                "FpmIdentityService",
                "worker identity arrives with forward-pass metrics",
            ),
            (
                forward_pass_metrics_service_pb2,
                forward_pass_metrics_service_pb2_grpc,
                "ForwardPassMetricsService",
                "forward-pass metrics arrive in a later release",
            ),
        )
        for pb2, pb2_grpc, name, arrives in pending:
            descriptor = pb2.DESCRIPTOR.services_by_name[name]
            servicer = _unimplemented_servicer(getattr(pb2_grpc, f"{name}Servicer"), descriptor, arrives)
            getattr(pb2_grpc, f"add_{name}Servicer_to_server")(servicer, self._server)
            services[name] = descriptor
        self.service_names = [d.full_name for d in services.values()]
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

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
        """Health of the whole server ("") and of every enginectl service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Graceful stop: NOT_SERVING first, streams end with UNAVAILABLE, then the server."""
        await self.health.enter_graceful_shutdown()
        self.ledger.close()
        await self._server.stop(grace)
