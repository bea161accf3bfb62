"""gRPC server interceptors: structured RPC logs, error translation, bearer-token auth.

Runs in the `enginectl serve` process. `RpcLogInterceptor` wraps every handler once: it
times the call, turns a ControlPlaneError into a google.rpc.Status (ErrorInfo + BadRequest)
and logs rpc, request id, status code and duration. `BearerTokenInterceptor` refuses
mutating RPCs without the configured token; reads, health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_status import rpc_status

from enginectl.server.errors import ControlPlaneError, Reason, to_status

log = structlog.get_logger("enginectl.rpc")

REQUEST_ID_HEADER = "x-request-id"
# Methods whose name starts with one of these only read state; everything else of ours
# mutates and needs the token. Default-deny: a new RPC is guarded until listed here.
READ_ONLY_PREFIXES = ("Get", "List", "Watch", "Stream", "Wait", "Verify")
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    return {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}


async def _abort(context: grpc.aio.ServicerContext, err: ControlPlaneError) -> None:
    status = rpc_status.to_status(to_status(err))
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler like `handler` but calling `behavior`."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behavior, **kwargs)


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return (
        handler.unary_unary
        or handler.unary_stream
        or handler.stream_unary
        or handler.stream_stream
    )


class RpcLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs every RPC and maps ControlPlaneError to a rich status."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        request_id = _metadata(handler_call_details).get(REQUEST_ID_HEADER) or uuid.uuid4().hex[:16]
        behavior = _behavior(handler)

        def done(context: grpc.aio.ServicerContext, start: float, error: BaseException | None) -> None:
            code = context.code() if hasattr(context, "code") else None
            if isinstance(code, int):  # some grpc versions return the raw integer
                code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
            name = code.name if isinstance(code, grpc.StatusCode) else "OK"
            if error is not None and name == "OK":
                name = "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"
            fields = {"rpc": method, "request_id": request_id, "code": name,
                      "duration_ms": round((time.perf_counter() - start) * 1e3, 3)}
            if method.startswith(OPEN_SERVICES):  # probes and tooling: keep them out of the way
                log.debug("rpc", **fields)
            elif name in ("OK", "CANCELLED"):
                log.info("rpc", **fields)
            else:
                log.warning("rpc", **fields)

        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, error = time.perf_counter(), None
                try:
                    async for item in behavior(request, context):
                        yield item
                except ControlPlaneError as err:
                    await _abort(context, err)
                except BaseException as err:  # logged, then re-raised to gRPC
                    error = err
                    raise
                finally:
                    done(context, start, error)

            return _rebuild(handler, streaming)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start, error = time.perf_counter(), None
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except ControlPlaneError as err:
                await _abort(context, err)
            except BaseException as err:
                error = err
                raise
            finally:
                done(context, start, error)

        return _rebuild(handler, unary)


def is_read_only(method: str) -> bool:
    """True for RPCs that only read state (and for health and reflection)."""
    if method.startswith(OPEN_SERVICES):
        return True
    name = method.rsplit("/", 1)[-1]
    return name.startswith(READ_ONLY_PREFIXES)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every mutating RPC."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty token")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or is_read_only(handler_call_details.method):
            return handler
        given = _metadata(handler_call_details).get("authorization", "").encode()
        if hmac.compare_digest(given, self._expected):
            return handler
        err = ControlPlaneError(
            grpc.StatusCode.UNAUTHENTICATED,
            Reason.UNAUTHENTICATED,
            "this RPC changes state and needs 'authorization: Bearer <token>'",
        )

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _abort(context, err)

        if handler.response_streaming:

            async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _abort(context, err)
                yield  # pragma: no cover - makes this an async generator

            return _rebuild(handler, refuse_stream)
        return _rebuild(handler, refuse)
