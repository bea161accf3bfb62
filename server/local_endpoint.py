"""LocalEndpoint: the control plane's RPCs called from inside the process, through the same
interceptor and servicers a gRPC call reaches, without a socket.

Runs in the `enginectl serve` process, on the control loop. ControlPlaneServer registers every
servicer through it (it passes each registration on to the grpc.aio server and keeps the
handlers), so `call` finds the very handler gRPC would run and goes through RpcInterceptor's
`intercept_service`: the token check, the refusal once the engine died, the prompt-call count,
logs and metrics. What differs is only the transport: the request is a message already, the
context is a LocalContext (server/servicer_context.py), and the answer (or the
google.rpc.Status the interceptor aborts with, as `CallAborted`) comes back as an object.
Callers reach it through LocalPlane (server/local_plane.py), one typed call per RPC; a gRPC
round trip through the process's own port would cost the HTTP routes a second protocol stack
per call (bench/, "http").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2

from enginectl.server.errors import CallAborted
from enginectl.server.interceptors import RpcInterceptor
from enginectl.server.servicer_context import LocalContext, ServicerContext


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class LocalEndpoint:
    """Stands where a grpc.aio server is handed to `add_*Servicer_to_server`: passes every
    registration on to `server` and keeps the handlers, for `call`."""

    def __init__(self, server: grpc.aio.Server, interceptor: RpcInterceptor) -> None:
        self._server = server
        self._interceptor = interceptor
        self._generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, handlers)

    def _handler(self, details: _CallDetails) -> grpc.RpcMethodHandler | None:
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def call(
        self,
        method: str,
        request: Message,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
        peer: str = "local",
    ) -> Message:
        """Run the unary RPC `method` ("/pkg.Service/Method") with `request`, as the gRPC
        server would, for `peer` (who called, as gRPC names a peer); returns its response or
        raises CallAborted with its status."""
        details = _CallDetails(method, tuple(metadata))

        async def found(call_details: Any) -> grpc.RpcMethodHandler | None:
            return self._handler(call_details)

        handler = await self._interceptor.intercept_service(found, details)
        if handler is None or handler.unary_unary is None:
            raise CallAborted(
                status_pb2.Status(code=grpc.StatusCode.UNIMPLEMENTED.value[0], message=f"no unary RPC {method}")
            )
        context: ServicerContext = LocalContext(metadata, timeout, peer=peer)
        answer: Message = await handler.unary_unary(request, context)
        return answer
