"""Long-running operations (AIP-151) for weight updates: the store the Operations servicer reads.

Runs in the `enginectl serve` process, on the control loop. An `UpdateOperation` is created
once an update passed validation; its metadata (UpdateWeightsMetadata) is updated in place as
the update moves through its phases; it ends with a response (UpdateWeightsResponse) or an
error (google.rpc.Status). Finished operations are kept for the last `retained` updates.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc
from google.longrunning import operations_pb2
from google.protobuf import any_pb2
from google.rpc import status_pb2

from enginectl.contract.engine import Cause
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import MAX_RETAINED
from enginectl.weights.v1 import weight_update_service_pb2 as pb2


class UpdateOperation:
    """One weight update as an Operation; mutated only on the control loop."""

    def __init__(self, name: str, metadata: pb2.UpdateWeightsMetadata) -> None:
        self.name = name
        self.metadata = metadata
        self.response: pb2.UpdateWeightsResponse | None = None
        self.error: status_pb2.Status | None = None
        self.finished = asyncio.Event()
        # Set by cancel(); the update checks it before loading.
        self.cancel_requested = asyncio.Event()
        # Stops the update's workers (set by the update once its channels exist).
        self.on_abort: Callable[[Cause, str], None] | None = None
        # The error as raised, for calls that end with it (the tensor stream).
        self.failure: ControlPlaneError | None = None

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def cancel(self) -> None:
        """CancelOperation (or shutdown): stop the update if it still runs."""
        if self.done:
            return
        self.cancel_requested.set()
        if self.on_abort is not None:
            self.on_abort(Cause.UPDATE_CANCELLED, "CancelOperation")

    def touch(self) -> None:
        self.metadata.update_time.FromNanoseconds(time.time_ns())

    def set_phase(self, phase: pb2.UpdatePhase.ValueType) -> None:
        """The update (and every rank of it) is in `phase` now."""
        self.metadata.phase = phase
        for rank in self.metadata.ranks:
            rank.phase = phase
        self.touch()

    async def follow_progress(self, reports: Callable[[], Awaitable[tuple[int, int, int]]]) -> None:
        """Fold the workers' progress reports ((dp_rank, tensors, bytes) from `reports`, the
        update's channels) into the metadata, until cancelled."""
        done: dict[int, tuple[int, int]] = {}
        while True:
            self.record_progress(done, *await reports())

    def record_progress(
        self, done: dict[int, tuple[int, int]], rank: int, tensors: int, nbytes: int, *, writing: bool = True
    ) -> None:
        """One worker's report into the metadata (`done`: the latest report per rank); the
        totals count once every rank reported. `writing`: the tensors went into the model
        (a load), not into a staging buffer."""
        done[rank] = (tensors, nbytes)
        for progress in self.metadata.ranks:
            if progress.dp_rank == rank:
                progress.tensors_done, progress.bytes_done = tensors, nbytes
                if writing:
                    progress.phase = pb2.UPDATE_PHASE_LOADING
        complete = len(done) == len(self.metadata.ranks)
        self.metadata.tensors_done = min(t for t, _ in done.values()) if complete else 0
        self.metadata.bytes_done = min(b for _, b in done.values()) if complete else 0
        if writing and self.metadata.tensors_done:
            self.metadata.phase = pb2.UPDATE_PHASE_LOADING
            self.metadata.weights_modified = True
        self.touch()

    def finish(
        self, *, response: pb2.UpdateWeightsResponse | None = None, error: status_pb2.Status | None = None
    ) -> None:
        self.response, self.error = response, error
        self.metadata.end_time.FromNanoseconds(time.time_ns())
        self.touch()
        self.finished.set()

    def proto(self) -> operations_pb2.Operation:
        op = operations_pb2.Operation(name=self.name, done=self.done)
        op.metadata.Pack(self.metadata)
        if self.error is not None:
            op.error.CopyFrom(self.error)
        elif self.response is not None:
            response = any_pb2.Any()
            response.Pack(self.response)
            op.response.CopyFrom(response)
        return op


class OperationStore:
    """The operations of this incarnation, newest last; finished ones beyond `retained` go."""

    def __init__(self, retained: int = MAX_RETAINED) -> None:
        self._ops: OrderedDict[str, UpdateOperation] = OrderedDict()
        self._retained = retained
        self.closing = asyncio.Event()  # the server is going away: waiters end now
        self._close_error: ControlPlaneError | None = None

    def close(self, reason: str = Reason.SHUTTING_DOWN, message: str = "server is shutting down") -> None:
        """End every call that waits on an Operation with UNAVAILABLE `reason`."""
        if self._close_error is None:
            self._close_error = ControlPlaneError(grpc.StatusCode.UNAVAILABLE, reason, message)
        self.closing.set()

    def closed_error(self) -> ControlPlaneError:
        """The error a call waiting on an Operation ends with once the store closed."""
        error = self._close_error
        assert error is not None, "closed_error before close"
        return ControlPlaneError(error.code, error.reason, error.message, metadata=error.metadata)

    async def wait(self, op: UpdateOperation, timeout: float | None) -> None:
        """Until `op` finishes or `timeout` passes (asyncio.TimeoutError); raises
        UNAVAILABLE (SHUTTING_DOWN or ENGINE_DEAD) once the store closes."""
        finished = asyncio.ensure_future(op.finished.wait())
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            done, _ = await asyncio.wait({finished, closing}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
            closing.cancel()
        if op.finished.is_set():
            return
        if self.closing.is_set():
            raise self.closed_error()
        raise asyncio.TimeoutError()

    def add(self, op: UpdateOperation) -> None:
        self._ops[op.name] = op
        finished = [name for name, o in self._ops.items() if o.done]
        for name in finished[: max(0, len(finished) - self._retained)]:
            del self._ops[name]

    def find(self, name: str) -> UpdateOperation | None:
        return self._ops.get(name)

    def get(self, name: str) -> UpdateOperation:
        if not name.startswith("operations/"):
            raise invalid_field(Reason.OPERATION_NAME_INVALID, "name", 'must look like "operations/<id>"')
        op = self._ops.get(name)
        if op is None:
            raise ControlPlaneError(
                grpc.StatusCode.NOT_FOUND,
                Reason.OPERATION_NOT_FOUND,
                f"no operation {name!r} in this incarnation (or it was evicted)",
            )
        return op

    def delete(self, name: str) -> None:
        self._ops.pop(name, None)

    def list(self) -> list[UpdateOperation]:
        return list(reversed(self._ops.values()))  # newest first
