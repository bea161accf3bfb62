"""LocalCalls: the HTTP routes' way into the control plane, the same RPCs any gRPC client calls.

Runs in the `enginectl serve` process. The routes run on the engine's loop (vLLM's HTTP
server); each call is carried to the control loop (server/control_loop.py) and run there by
the control plane's local endpoint (server/local_endpoint.py): the interceptor (token,
refusals once the engine died, logs, metrics), the servicer, the ledger, the update state
machine, etag and request_id rules, as for a call on the gRPC port. Nothing here touches
weights.

A refusal comes back as `RouteError`, with the status the servicer answered (code, reason,
message, ErrorInfo metadata, BadRequest violations); server/http/answers.py turns it into a
JSON body and an HTTP status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
from google.longrunning import operations_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from enginectl.common.vocabulary import Reason
from enginectl.server.errors import CallAborted

T = TypeVar("T", bound=Message)

# A read or a pause: answered in milliseconds, bounded anyway.
UNARY_TIMEOUT_S = 60.0
# One WaitOperation while an update runs; repeated until the update is done.
WAIT_SLICE_S = 30.0


@dataclass
class RouteError(Exception):
    """A call the control plane refused or failed, as its google.rpc.Status said."""

    code: grpc.StatusCode
    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)
    violations: list[dict[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


def status_error(status: status_pb2.Status) -> RouteError:
    """The RouteError a google.rpc.Status (an RPC's or an Operation's) stands for."""
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    error = RouteError(code, code.name, status.message)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            error.reason, error.metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            error.violations = [{"field": v.field, "description": v.description} for v in bad.field_violations]
    return error


class Invoke(Protocol):
    """Runs one unary RPC in process (server/local_endpoint.py, LocalEndpoint.call)."""

    def __call__(
        self, method: str, request: Message, metadata: Sequence[tuple[str, str]] = (), timeout: float | None = None
    ) -> Awaitable[Message]: ...


class LocalCalls:
    """Unary calls into this server's control plane through `invoke`, run on `control_loop`
    (which owns the control plane), awaited from any loop."""

    def __init__(self, invoke: Invoke, control_loop: asyncio.AbstractEventLoop) -> None:
        self._invoke = invoke
        self._loop = control_loop

    async def call(
        self,
        method: str,
        request: Message,
        response_type: type[T],
        *,
        authorization: str | None = None,
        request_id: str | None = None,
        timeout: float = UNARY_TIMEOUT_S,
    ) -> T:
        """`method` ("/pkg.Service/Method") with `request`; raises RouteError on a refusal.
        `authorization` is the HTTP request's Authorization header, passed on as it is."""
        metadata: list[tuple[str, str]] = []
        if authorization:
            metadata.append(("authorization", authorization))
        if request_id:
            metadata.append(("x-request-id", request_id))

        async def run() -> T:
            try:
                answer = await self._invoke(method, request, metadata, timeout)
            except CallAborted as aborted:
                raise status_error(aborted.status) from None
            if not isinstance(answer, response_type):
                raise RouteError(grpc.StatusCode.INTERNAL, "INTERNAL", f"{method} answered a {type(answer).__name__}")
            return answer

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    async def operation(
        self,
        method: str,
        request: Message,
        response_type: type[T],
        *,
        authorization: str | None = None,
        request_id: str | None = None,
        within: float,
    ) -> T:
        """An RPC that starts an update Operation, answered when the Operation is done (an
        HTTP caller neither streams nor polls): its response, or RouteError with its error.
        `within`: how long the update may take (its own timeout); waiting ends a little after."""
        op = await self.call(
            method, request, operations_pb2.Operation, authorization=authorization, request_id=request_id
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within + WAIT_SLICE_S
        while not op.done:
            left = deadline - loop.time()
            if left <= 0:
                raise RouteError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    Reason.UPDATE_TIMEOUT,
                    f"{op.name} did not finish within its timeout; it may still be running",
                    metadata={"operation": op.name},
                )
            wait = operations_pb2.WaitOperationRequest(name=op.name)
            wait.timeout.FromMilliseconds(int(min(WAIT_SLICE_S, left) * 1000))
            op = await self.call(
                "/google.longrunning.Operations/WaitOperation",
                wait,
                operations_pb2.Operation,
                authorization=authorization,
                timeout=min(WAIT_SLICE_S, left) + 5.0,
            )
        if op.HasField("error"):
            error = status_error(op.error)
            error.metadata.setdefault("operation", op.name)
            raise error
        return _unpack(op.response, response_type)


def _unpack(packed: any_pb2.Any, response_type: type[T]) -> T:
    answer = response_type()
    packed.Unpack(answer)
    return answer
