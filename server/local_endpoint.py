"""LocalEndpoint: the control plane's RPCs called from inside the process, through the same
interceptor and servicers a gRPC call reaches, without a socket.

Runs in the `enginectl serve` process, on the control loop. ControlPlaneServer registers every
servicer through it (it passes each registration on to the grpc.aio server and keeps the
handlers), so `call` finds the very handler gRPC would run and goes through RpcInterceptor's
`intercept_service`: the token check, the refusal once the engine died, the prompt-call count,
logs and metrics. What differs is only the transport: the request is a message already, and
the answer (or the google.rpc.Status the interceptor aborts with, as `CallAborted`) comes
back as an object. The HTTP RL routes (server/http/) call it; a gRPC round trip through
the process's own port would cost them a second protocol stack per call (bench/, "http").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2

from enginectl.server.errors import CallAborted
from enginectl.server.interceptors import RpcInterceptor

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _LocalContext:
    """The ServicerContext of a local call: its metadata and deadline; `abort` raises
    CallAborted with the status."""

    def __init__(self, metadata: Sequence[tuple[str, str]], timeout: float | None) -> None:
        self._metadata = tuple(metadata)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "local"

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass  # only Generate sets trailers, and it streams: never called locally

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code = code
        for key, value in trailing_metadata or ():
            if key == STATUS_DETAILS_KEY:
                raise CallAborted(status_pb2.Status.FromString(value))
        raise CallAborted(status_pb2.Status(code=code.value[0], message=details))


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
        self, method: str, request: Message, metadata: Sequence[tuple[str, str]] = (), timeout: float | None = None
    ) -> Message:
        """Run the unary RPC `method` ("/pkg.Service/Method") with `request`, as the gRPC
        server would; returns its response or raises CallAborted with its status."""
        details = _CallDetails(method, tuple(metadata))

        async def found(call_details: Any) -> grpc.RpcMethodHandler | None:
            return self._handler(call_details)

        handler = await self._interceptor.intercept_service(found, details)
        if handler is None or handler.unary_unary is None:
            raise CallAborted(
                status_pb2.Status(code=grpc.StatusCode.UNIMPLEMENTED.value[0], message=f"no unary RPC {method}")
            )
        answer: Message = await handler.unary_unary(request, _LocalContext(metadata, timeout))
        return answer
