"""google.longrunning.Operations for the trainer client: read, wait for (with a progress
bar), and cancel weight-update Operations.

Runs in the trainer process. `UpdateOperations` holds the Operations stub and the waiting;
AsyncTrainerClient (client/trainer.py) holds one and forwards its `*_operation` methods to
it, and its other helpers wait for the Operations they start with it.
"""

from __future__ import annotations

import time

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from enginectl.client.client import Connection
from enginectl.client.errors import DeadlineExceededError
from enginectl.client.progress import ProgressBar
from enginectl.client.trainer_requests import UpdateOptions, duration
from enginectl.client.trainer_types import UpdateOperation, UpdateResult

POLL_S = 0.2  # WaitOperation slice while drawing progress
WAIT_SLICE_S = 60.0  # WaitOperation slice otherwise


def require_done(op: UpdateOperation, timeout: float | None) -> UpdateOperation:
    """`op`, once waited for `timeout` seconds; DeadlineExceededError if it still runs."""
    if not op.done:
        raise DeadlineExceededError(
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
            message=f"{op.name} still running after {timeout:.1f}s (phase "
            f"{op.progress.phase}); wait_operation or cancel_operation it",
        )
    return op


class UpdateOperations:
    """The Operations of weight updates on one connection."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._stub = operations_pb2_grpc.OperationsStub(connection.channel)

    async def get_operation(self, name: str, *, timeout: float | None = None) -> UpdateOperation:
        """An update Operation as it is now."""
        request = operations_pb2.GetOperationRequest(name=name)
        return UpdateOperation.from_proto(await self._connection.unary(self._stub.GetOperation, request, timeout))

    async def list_operations(self, *, done: bool | None = None, timeout: float | None = None) -> list[UpdateOperation]:
        """The update Operations this server incarnation keeps, newest first (running ones, and
        the most recent finished ones); `done` True or False keeps only finished or running
        ones. Reads every page."""
        request = operations_pb2.ListOperationsRequest(filter="" if done is None else f"done={str(done).lower()}")
        ops: list[UpdateOperation] = []
        while True:
            page = await self._connection.unary(self._stub.ListOperations, request, timeout)
            ops.extend(UpdateOperation.from_proto(op) for op in page.operations)
            if not page.next_page_token:
                return ops
            request.page_token = page.next_page_token

    async def wait_operation(
        self, name: str, timeout: float | None = None, *, progress: bool = False
    ) -> UpdateOperation:
        """Wait until the Operation is done or `timeout` (None: no bound) elapsed; returns it
        as it then is (check `done`; `result()` raises its error)."""
        bar = ProgressBar() if progress else None
        try:
            return await self._await_done(name, timeout, bar)
        finally:
            if bar is not None:
                bar.close()

    async def cancel_operation(self, name: str, *, timeout: float | None = None) -> None:
        """Ask the server to stop the update (its error becomes UPDATE_CANCELLED)."""
        request = operations_pb2.CancelOperationRequest(name=name)
        await self._connection.unary(self._stub.CancelOperation, request, timeout)

    async def until_done(self, name: str, timeout: float | None, progress: bool) -> UpdateOperation:
        """The Operation once done (see require_done when `timeout` passes first)."""
        return require_done(await self.wait_operation(name, timeout, progress=progress), timeout)

    async def finish(
        self, op: UpdateOperation, options: UpdateOptions, progress: bool, wait: bool
    ) -> UpdateResult | UpdateOperation:
        """What an update method returns: `op` itself without `wait`, else its result once
        done (its error raised)."""
        if not wait:
            return op
        return (await self.until_done(op.name, options.wait_bound(), progress)).result()

    async def _wait_slice(self, name: str, seconds: float) -> UpdateOperation:
        request = operations_pb2.WaitOperationRequest(name=name, timeout=duration(max(seconds, 0.001)))
        op = await self._connection.unary(self._stub.WaitOperation, request, seconds + self._connection.config.timeout)
        return UpdateOperation.from_proto(op)

    async def _await_done(self, name: str, timeout: float | None, bar: ProgressBar | None) -> UpdateOperation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_s = POLL_S if bar is not None else WAIT_SLICE_S
            if deadline is not None:
                slice_s = min(slice_s, deadline - time.monotonic())
            op = await self._wait_slice(name, slice_s)
            if bar is not None:
                bar.update(op.progress)
            if op.done or (deadline is not None and time.monotonic() >= deadline):
                return op
