"""google.longrunning.Operations for the trainer client: read, wait for (with a progress
bar), and cancel weight-update Operations.

Runs in the trainer process. `AsyncOperationsClient` holds the Operations stub and the
waiting; AsyncTrainerClient (client/trainer.py) extends it with the update RPCs that start
the Operations.
"""

from __future__ import annotations

import time
from typing import Unpack

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from enginectl.client.client import DEFAULT_TARGET, AsyncClient, ChannelOptions
from enginectl.client.errors import DeadlineExceededError
from enginectl.client.progress import ProgressBar
from enginectl.client.trainer_requests import UpdateOptions, duration
from enginectl.client.trainer_types import UpdateOperation, UpdateResult

POLL_S = 0.2  # WaitOperation slice while drawing progress
WAIT_SLICE_S = 60.0  # WaitOperation slice otherwise


class AsyncOperationsClient(AsyncClient):
    """AsyncClient with the Operations of weight updates."""

    def __init__(self, target: str = DEFAULT_TARGET, **config: Unpack[ChannelOptions]) -> None:
        super().__init__(target, **config)
        self._operations = operations_pb2_grpc.OperationsStub(self._channel)

    async def get_operation(self, name: str, *, timeout: float | None = None) -> UpdateOperation:
        """An update Operation as it is now."""
        op = await self._unary(self._operations.GetOperation, operations_pb2.GetOperationRequest(name=name), timeout)
        return UpdateOperation.from_proto(op)

    async def list_operations(self, *, done: bool | None = None, timeout: float | None = None) -> list[UpdateOperation]:
        """The update Operations this server incarnation keeps, newest first (running ones, and
        the most recent finished ones); `done` True or False keeps only finished or running
        ones. Reads every page."""
        request = operations_pb2.ListOperationsRequest(filter="" if done is None else f"done={str(done).lower()}")
        ops: list[UpdateOperation] = []
        while True:
            page = await self._unary(self._operations.ListOperations, request, timeout)
            ops.extend(UpdateOperation.from_proto(op) for op in page.operations)
            if not page.next_page_token:
                return ops
            request.page_token = page.next_page_token

    async def wait_operation(
        self, name: str, timeout: float | None = None, *, progress: bool = False
    ) -> UpdateOperation:
        """Wait until the Operation is done or `timeout` (None: no bound) elapsed; returns it
        as it then is (check `done`; `result()` raises its error)."""
        return await self._await_operation(name, timeout, progress, raise_on_deadline=False)

    async def cancel_operation(self, name: str, *, timeout: float | None = None) -> None:
        """Ask the server to stop the update (its error becomes UPDATE_CANCELLED)."""
        await self._unary(self._operations.CancelOperation, operations_pb2.CancelOperationRequest(name=name), timeout)

    async def _wait_slice(self, name: str, seconds: float) -> UpdateOperation:
        request = operations_pb2.WaitOperationRequest(name=name, timeout=duration(max(seconds, 0.001)))
        op = await self._unary(self._operations.WaitOperation, request, seconds + self.config.timeout)
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

    async def _await_operation(
        self, name: str, timeout: float | None, progress: bool, *, raise_on_deadline: bool = True
    ) -> UpdateOperation:
        bar = ProgressBar() if progress else None
        try:
            op = await self._await_done(name, timeout, bar)
        finally:
            if bar is not None:
                bar.close()
        if not op.done and raise_on_deadline:
            raise DeadlineExceededError(
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                message=f"{name} still running after {timeout:.1f}s (phase "
                f"{op.progress.phase}); wait_operation or cancel_operation it",
            )
        return op

    async def _finish(
        self, op: UpdateOperation, options: UpdateOptions, progress: bool, wait: bool
    ) -> UpdateResult | UpdateOperation:
        if not wait:
            return op
        return (await self._await_operation(op.name, options.wait_bound(), progress)).result()
