"""google.longrunning.Operations servicer: proto <-> OperationStore.

Runs in the `enginectl serve` process, on the control loop. Thin on purpose: the operations
themselves live in weights/update/operations.py; errors raised as ControlPlaneError become
google.rpc.Status in the interceptor.
"""

from __future__ import annotations

import asyncio

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import empty_pb2

from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import DEFAULT_WAIT_OPERATION_S, MAX_PAGE_SIZE
from enginectl.server.servicer_context import ServicerContext
from enginectl.server.weights.update.operations import OperationStore


class OperationsServicer(operations_pb2_grpc.OperationsServicer):
    """google.longrunning.Operations over an OperationStore."""

    def __init__(self, store: OperationStore) -> None:
        self._store = store

    async def GetOperation(
        self, request: operations_pb2.GetOperationRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return self._store.get(request.name).proto()

    async def ListOperations(
        self, request: operations_pb2.ListOperationsRequest, context: ServicerContext
    ) -> operations_pb2.ListOperationsResponse:
        if request.filter not in ("", "done=true", "done=false"):
            raise invalid_field(Reason.FILTER_INVALID, "filter", 'only "", "done=true" or "done=false"')
        if request.page_size < 0:
            raise invalid_field(Reason.PAGE_SIZE_INVALID, "page_size", "must not be negative")
        ops = self._store.list()
        if request.filter:
            want = request.filter == "done=true"
            ops = [op for op in ops if op.done == want]
        start = 0
        if request.page_token:
            # A token is the offset a previous page answered: ASCII digits, nothing else (int()
            # would also take "-1", " 1" and other scripts' digits).
            if not (request.page_token.isascii() and request.page_token.isdigit()):
                raise invalid_field(Reason.PAGE_TOKEN_INVALID, "page_token", "not a token from a previous page")
            start = int(request.page_token)
        size = min(request.page_size or MAX_PAGE_SIZE, MAX_PAGE_SIZE)
        page = ops[start : start + size]
        response = operations_pb2.ListOperationsResponse(operations=[op.proto() for op in page])
        if start + size < len(ops):
            response.next_page_token = str(start + size)
        return response

    async def WaitOperation(
        self, request: operations_pb2.WaitOperationRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        op = self._store.get(request.name)
        timeout = DEFAULT_WAIT_OPERATION_S
        if request.HasField("timeout"):
            timeout = request.timeout.ToNanoseconds() / 1e9  # ToTimedelta() overflows near 2**63 s
            if timeout <= 0:
                raise invalid_field(Reason.TIMEOUT_INVALID, "timeout", "must be positive")
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining - 0.05, 0.0))
        try:
            await self._store.wait(op, timeout)
        except asyncio.TimeoutError:
            pass  # AIP-151: return the operation as it is, not done yet
        return op.proto()

    async def CancelOperation(
        self, request: operations_pb2.CancelOperationRequest, context: ServicerContext
    ) -> empty_pb2.Empty:
        self._store.get(request.name).cancel()
        return empty_pb2.Empty()

    async def DeleteOperation(
        self, request: operations_pb2.DeleteOperationRequest, context: ServicerContext
    ) -> empty_pb2.Empty:
        op = self._store.get(request.name)
        if not op.done:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.OPERATION_RUNNING,
                f"{op.name} is still running; cancel it first",
            )
        self._store.delete(op.name)
        return empty_pb2.Empty()
