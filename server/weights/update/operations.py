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
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc
from google.longrunning import operations_pb2
from google.protobuf import any_pb2
from google.rpc import status_pb2

from enginectl.contract.engine import Cause, WorkerLayout
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field, to_status
from enginectl.server.limits import MAX_RETAINED
from enginectl.weights.v1 import weight_update_service_pb2 as pb2


class ProgressTally:
    """The latest progress report of every worker of one update, folded the way the
    Operation shows it: a DP rank has loaded what every worker of it has loaded (with tensor
    parallelism each worker loads every tensor, its own shard of it), and the update what
    every rank has."""

    def __init__(self, layout: WorkerLayout) -> None:
        self.layout = layout
        self.latest: dict[tuple[int, int], tuple[int, int]] = {}  # (dp_rank, worker) -> (tensors, bytes)

    def rank(self, dp_rank: int) -> tuple[int, int] | None:
        """(tensors, bytes) every worker of `dp_rank` has done; None until each reported."""
        reports = [self.latest.get((dp_rank, w)) for w in range(self.layout.workers_per_rank)]
        if any(r is None for r in reports):
            return None
        return min(r[0] for r in reports if r), min(r[1] for r in reports if r)

    def total(self) -> tuple[int, int] | None:
        """(tensors, bytes) every worker of every rank has done; None until each reported."""
        ranks = [self.rank(r) for r in self.layout.dp_ranks]
        if any(r is None for r in ranks):
            return None
        return min(r[0] for r in ranks if r), min(r[1] for r in ranks if r)


class Stoppable(Protocol):
    """What an Operation asks of its update's source (update/source.py UpdateSource)."""

    def abort(self, cause: Cause, message: str) -> None: ...


class UpdateOperation:
    """One weight update as an Operation; mutated only on the control loop."""

    def __init__(self, name: str, metadata: pb2.UpdateWeightsMetadata, source: Stoppable | None = None) -> None:
        self.name = name
        self.metadata = metadata
        self.response: pb2.UpdateWeightsResponse | None = None
        self.error: status_pb2.Status | None = None
        self.finished = asyncio.Event()
        # Set by cancel(); the update checks it before loading.
        self.cancel_requested = asyncio.Event()
        # How the update's weights arrive, chosen once when the update started: it stops them
        # (None: an Operation with nothing to stop, as a test builds one).
        self._source = source
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
        self.abort(Cause.UPDATE_CANCELLED, "CancelOperation")

    def abort(self, cause: Cause, message: str) -> None:
        """Stop the update if it still runs (a broken stream): its source stops the workers."""
        if not self.done and self._source is not None:
            self._source.abort(cause, message)

    def record_modified(self, modified: bool) -> None:
        """Whether the update wrote into the model (as the update's outcome knows it)."""
        self.metadata.weights_modified = modified

    def record_paused_by_update(self, paused: bool) -> None:
        self.metadata.paused_by_update = paused

    def record_done(self, tensors: int, nbytes: int) -> None:
        """The tensors and bytes the update has moved so far (a transfer round's batches)."""
        self.metadata.tensors_done, self.metadata.bytes_done = tensors, nbytes
        self.touch()

    def touch(self) -> None:
        self.metadata.update_time.FromNanoseconds(time.time_ns())

    def set_phase(self, phase: pb2.UpdatePhase.ValueType) -> None:
        """The update (and every rank of it) is in `phase` now."""
        self.metadata.phase = phase
        for rank in self.metadata.ranks:
            rank.phase = phase
        self.touch()

    async def follow_progress(
        self, tally: ProgressTally, reports: Callable[[], Awaitable[tuple[int, int, int, int]]]
    ) -> None:
        """Fold the workers' progress reports ((dp_rank, worker_rank, tensors, bytes) from
        `reports`, the update's channels) into the metadata, until cancelled."""
        while True:
            self.record_progress(tally, *await reports())

    def record_progress(
        self, tally: ProgressTally, rank: int, worker: int, tensors: int, nbytes: int, *, writing: bool = True
    ) -> None:
        """One worker's report into the metadata (`tally`: the latest report per worker). A
        rank's progress is what every worker of it has done; the totals count once every
        worker reported. `writing`: the tensors went into the model (a load), not into a
        staging buffer."""
        tally.latest[(rank, worker)] = (tensors, nbytes)
        done = tally.rank(rank)
        for progress in self.metadata.ranks:
            if progress.dp_rank != rank:
                continue
            entry = _worker_entry(progress, worker)
            entry.tensors_loaded, entry.bytes_loaded = tensors, nbytes
            entry.weights_modified = entry.weights_modified or (writing and tensors > 0)
            if done is not None:
                progress.tensors_done, progress.bytes_done = done
            if writing and tensors:
                progress.phase = pb2.UPDATE_PHASE_LOADING
        total = tally.total()
        self.metadata.tensors_done, self.metadata.bytes_done = total if total is not None else (0, 0)
        if writing and tensors:
            # This worker handed a tensor to the model: the weights may be mixed now, even if
            # another worker of the rank has not loaded one yet.
            self.metadata.phase = pb2.UPDATE_PHASE_LOADING
            self.metadata.weights_modified = True
        self.touch()

    def record_results(self, results: Sequence[pb2.RankUpdateResult]) -> None:
        """The workers' own account of how their load ended (load_results_proto of their
        results, which the rate-limited progress reports may not have caught up with): each
        rank's totals and every worker's entry, success or not."""
        by_rank = {progress.dp_rank: progress for progress in self.metadata.ranks}
        for result in results:
            progress = by_rank.get(result.dp_rank)
            if progress is None:
                continue
            progress.tensors_done, progress.bytes_done = result.tensors_loaded, result.bytes_loaded
            del progress.workers[:]
            progress.workers.extend(result.workers)
        ranks = self.metadata.ranks
        if ranks and len(results) == len(ranks):  # the totals too: what every rank has done
            self.metadata.tensors_done = min(r.tensors_done for r in ranks)
            self.metadata.bytes_done = min(r.bytes_done for r in ranks)
        self.touch()

    def fail(self, error: ControlPlaneError) -> None:
        """End with `error` (kept as raised for the calls that end with it)."""
        self.failure = error
        self.finish(error=to_status(error))

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


def _worker_entry(progress: pb2.RankUpdateProgress, worker: int) -> pb2.WorkerLoad:
    """The entry of `worker` in a rank's progress, added in worker_rank order if missing."""
    for entry in progress.workers:
        if entry.worker_rank == worker:
            return entry
    entries = sorted([*progress.workers, pb2.WorkerLoad(worker_rank=worker)], key=lambda w: w.worker_rank)
    del progress.workers[:]
    progress.workers.extend(entries)
    return next(e for e in progress.workers if e.worker_rank == worker)
