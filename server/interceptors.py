"""gRPC server interceptor: bearer-token auth, error translation, structured RPC logs.

Runs in the `enginectl serve` process. One interceptor, `RpcInterceptor`, so that every
call (a refused one too) is checked, translated, logged and counted the same way; reads,
health and reflection never need the token.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import grpc
import structlog
from grpc_status import rpc_status

from enginectl.server.errors import ControlPlaneError, Reason, to_status
from enginectl.server.prompt_calls import PromptCalls

log = structlog.get_logger("enginectl.rpc")

REQUEST_ID_HEADER = "x-request-id"
# Methods whose name starts with one of these only read state; everything else of ours
# mutates and needs the token. Default-deny: a new RPC is guarded until listed here.
READ_ONLY_PREFIXES = ("Get", "List", "Watch", "Stream", "Wait", "Verify", "Subscribe", "HealthCheck")
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# While a read-only RPC of a server with a token runs: whether the call carried that token.
# Reads stay open, but may show an authenticated caller more (GetServerInfo lists
# allowed_weight_roots only then). False on servers without a token: consult auth first.
caller_authenticated: ContextVar[bool] = ContextVar("enginectl_caller_authenticated", default=False)


class BearerToken:
    """The token mutating RPCs must present as `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty token")
        self._expected = f"Bearer {token}".encode()

    def presented(self, context: grpc.aio.ServicerContext) -> bool:
        """True when the call carries the token (constant-time compare)."""
        given = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                given = value.encode()
        return hmac.compare_digest(given, self._expected)

    def check(self, context: grpc.aio.ServicerContext) -> None:
        """Raise UNAUTHENTICATED unless the call carries the token."""
        if not self.presented(context):
            raise ControlPlaneError(
                grpc.StatusCode.UNAUTHENTICATED,
                Reason.UNAUTHENTICATED,
                "this RPC changes state and needs 'authorization: Bearer <token>'",
            )


async def _abort(context: grpc.aio.ServicerContext, err: ControlPlaneError) -> None:
    status = rpc_status.to_status(to_status(err))
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


class _Malformed:
    """Stands in for a request that did not parse, so the servicer wrapper can answer
    INVALID_ARGUMENT (gRPC itself would answer UNKNOWN for a deserializer exception)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, bad UTF-8, ...: answered MALFORMED_REQUEST
            return _Malformed(exc)

    return parse


def _check(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise ControlPlaneError(
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.MALFORMED_REQUEST,
            f"the request could not be parsed: {request.error}",
        )
    return request


async def _checked_stream(requests: Any) -> Any:
    async for request in requests:
        yield _check(request)


def _rebuild(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler like `handler` but calling `behavior` (and parsing with `request_deserializer`)."""
    kwargs = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
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
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def _status_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, int):  # some grpc versions report the raw integer
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return "OK" if error is None else "UNKNOWN"


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return value
    return uuid.uuid4().hex[:16]


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler once (cached per method) to, on each call:

    - once `refuse` was called (the engine died), answer every RPC but health and reflection
      with that error, reads included: this is the one place that keeps a server whose
      engine is gone from claiming a version for weights that no longer exist;
    - require the bearer token, when the server has one, on mutating RPCs but `open_methods`
      and on `guarded_methods`;
    - answer a request that does not parse with INVALID_ARGUMENT MALFORMED_REQUEST;
    - answer the methods of `not_served` with their error (UNIMPLEMENTED NOT_IMPLEMENTED:
      server/grpc_server.py says which), past the token and the parse, before any servicer;
    - turn a ControlPlaneError into a google.rpc.Status (ErrorInfo + BadRequest);
    - log it: every mutating RPC and every failure (refusals included) with rpc, request id,
      code and duration; successful reads (Get*, Watch*, health, reflection) only with
      `log_reads`, since pollers would flood the log and the line is most of a
      GetWeightVersion's cost (bench/);
    - report (rpc, code) to `on_done` (the metrics counter);
    - count the prompt calls in flight in `prompt_calls` (server/prompt_calls.py): unary calls
      but long polls (Wait*), from the moment gRPC hands the call to the server until its
      status is sent or the prompt window passed. Work that shares the control loop and can
      wait (the FPM relay's intake, server/fpm/relay_zmq.py) takes smaller bites meanwhile.
    """

    def __init__(
        self,
        *,
        token: BearerToken | None = None,
        log_reads: bool = False,
        on_done: Callable[[str, str], None] | None = None,
        open_methods: frozenset[str] = frozenset(),
        guarded_methods: frozenset[str] = frozenset(),
        not_served: Mapping[str, ControlPlaneError] | None = None,
        prompt_calls: PromptCalls | None = None,
    ) -> None:
        self._token = token
        # "/pkg.Service/Method" names that need no token though they are not reads (vLLM's
        # Generate: the data plane), and reads that need it all the same (server/rollouts.py).
        self._open = open_methods
        self._guarded = guarded_methods
        self._log_reads = log_reads
        self._on_done = on_done  # (rpc, code) of every finished call, e.g. a metrics counter
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        self._prompt: dict[str, bool] = {}  # per method: whether its calls count in prompt_calls
        self._refusal: ControlPlaneError | None = None
        # "/pkg.Service/Method" -> the error it answers with, whatever the request.
        self._not_served = dict(not_served or {})
        self._prompt_calls = prompt_calls if prompt_calls is not None else PromptCalls()

    def refuse(self, error: ControlPlaneError) -> None:
        """From now on, answer every call except health and reflection with `error` (e.g.
        UNAVAILABLE ENGINE_DEAD). Calls already running are not touched; open streams are
        ended by their own sources. Call on the server's loop."""
        self._refusal = error

    def _refused(self) -> ControlPlaneError | None:
        return None if self._refusal is None else _fresh(self._refusal)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler
            wrapped = self._wrapped[method] = self._wrap(method, handler)
            self._prompt[method] = not (
                handler.request_streaming or handler.response_streaming or method.rsplit("/", 1)[-1].startswith("Wait")
            )
        if self._prompt[method]:
            # This runs in the task gRPC made for the call, which ends once the status is
            # sent, whatever happens before (a cancelled call too).
            call = asyncio.current_task()
            if call is not None:
                self._prompt_calls.track(call)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = _behavior(handler)
        not_served = self._not_served.get(method)
        if not_served is not None:
            inner = _answering(not_served, streaming=handler.response_streaming)
        read_only = is_read_only(method)
        log_success = self._log_reads or not read_only
        on_done = self._on_done
        needs_token = method in self._guarded or (not read_only and method not in self._open)
        token = self._token if needs_token else None
        refused: Callable[[], ControlPlaneError | None] = _never if method.startswith(OPEN_SERVICES) else self._refused
        behavior = inner
        if read_only and not needs_token and self._token is not None:
            identify = self._token  # open, but the servicer may show the token's holder more
            if inspect.isasyncgenfunction(inner):

                async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    caller_authenticated.set(identify.presented(context))
                    async for item in inner(request, context):
                        yield item

            else:

                def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    caller_authenticated.set(identify.presented(context))
                    return inner(request, context)

        if token is not None:
            if inspect.isasyncgenfunction(inner):

                async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    token.check(context)
                    async for item in inner(request, context):
                        yield item

            else:

                def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    token.check(context)
                    return inner(request, context)

        def done(context: grpc.aio.ServicerContext, start: float, error: BaseException | None) -> bool:
            # A ControlPlaneError is counted before its status is sent (context.abort sends it
            # at once), so a client that reads /metrics after the error sees it counted.
            if isinstance(error, ControlPlaneError):
                name = error.code.name
            else:
                name = _status_name(context, error)
            if on_done is not None:
                on_done(method, name)
            ok = name in ("OK", "CANCELLED")
            if ok and not log_success:
                return True
            (log.info if ok else log.warning)(
                "rpc",
                rpc=method,
                request_id=_request_id(context),
                code=name,
                duration_ms=round((time.perf_counter() - start) * 1e3, 3),
            )
            return True

        # Requests parse leniently; a malformed one becomes INVALID_ARGUMENT MALFORMED_REQUEST.
        parse = _lenient(handler.request_deserializer)
        check = _checked_stream if handler.request_streaming else _check

        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, error, counted = time.perf_counter(), None, False
                try:
                    refusal = refused()
                    if refusal is not None:
                        raise refusal
                    async for item in behavior(check(request), context):
                        yield item
                except ControlPlaneError as err:
                    counted = done(context, start, err)
                    await _abort(context, err)
                except BaseException as err:  # logged, then re-raised to gRPC
                    error = err
                    raise
                finally:
                    if not counted:
                        done(context, start, error)

            return _rebuild(handler, streaming, parse)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start, error, counted = time.perf_counter(), None, False
            try:
                refusal = refused()
                if refusal is not None:
                    raise refusal
                result = behavior(check(request), context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except ControlPlaneError as err:
                counted = done(context, start, err)
                await _abort(context, err)
            except BaseException as err:
                error = err
                raise
            finally:
                if not counted:
                    done(context, start, error)

        return _rebuild(handler, unary, parse)


def _fresh(error: ControlPlaneError) -> ControlPlaneError:
    """A copy of `error` to raise (raising one instance again would grow its traceback)."""
    return ControlPlaneError(error.code, error.reason, error.message, metadata=error.metadata)


def _answering(error: ControlPlaneError, *, streaming: bool) -> Callable[..., Any]:
    """A behaviour that answers every call with `error`."""
    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            raise _fresh(error)
            yield  # pragma: no cover - makes this an async generator

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise _fresh(error)

    return unary


def _never() -> None:
    """Health and reflection are never refused: they say the server is NOT_SERVING."""
    return None


def is_read_only(method: str) -> bool:
    """True for RPCs that only read state (and for health and reflection)."""
    if method.startswith(OPEN_SERVICES):
        return True
    name = method.rsplit("/", 1)[-1]
    return name.startswith(READ_ONLY_PREFIXES)
