"""TransferRound: one round of vLLM's weight-transfer engine, as an update's source.

Runs in the `enginectl serve` process, on the control loop. The trainer drives the round with
its calls (WeightTransfer, transfer.py): each `update_weights` batch and the finish is queued
here and run on every worker (WorkerRpc.TRANSFER, worker/weights/transfer/) by the round's
update (its UpdateRun, or the stage's Staging), each waited for within the step timeout and
the round's deadline. As the source of that update (update/plans.py UpdateSource), the round
loads (the engine's start, the batches, the finish) or stages (the same steps, START carrying
the set's token so every worker points the engine at its staging buffer), stops with
CancelOperation (an ABORT step), and answers the version the finish named instead of changing
the run (docs/weights.md, "vLLM's weight-transfer engines").

Once the engine may have written into the model (any batch of an engine that loads as it
receives; the finish of one that applies at its finish, as enginectl's `gloo`), a failure is
partial: `modified` says so.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from enginectl.common import dtypes
from enginectl.contract.engine import (
    GLOO_TRANSFER_BACKEND,
    LOAD_RPC_GRACE_S,
    QUICK_RPC_TIMEOUT_S,
    Cause,
    LoadResult,
    TransferAnswer,
    TransferStep,
)
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.weights.engine_protocols import TransferEngine
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.update.outcome import UpdateFailed
from enginectl.server.weights.update.plans import Loaded, Staged, TensorInfo, UpdatePlan

# Engines that touch the model only in their finish (a failed batch leaves it whole).
APPLIES_AT_FINISH = frozenset({GLOO_TRANSFER_BACKEND})
# Engines whose rounds can stage (`stage_only`): they write through vLLM's weight-update target
# (set_weight_update_target), which a stage points at the workers' staging buffers. vLLM's own
# engines open its layerwise reload on the target, which a staging buffer is not.
STAGES = frozenset({GLOO_TRANSFER_BACKEND})


@dataclass
class _Step:
    kind: TransferStep  # UPDATE, FINISH, or ABORT (cancel, shutdown: `payload` is (cause, message))
    payload: Any
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class TransferRound:
    """One round's steps, fed by the trainer's calls and run by its UpdateRun."""

    def __init__(self, engine: TransferEngine, backend: str, step_timeout: float) -> None:
        self._engine = engine
        self._applies_at_finish = backend in APPLIES_AT_FINISH
        self.step_timeout = step_timeout
        self._op: UpdateOperation | None = None
        self.batches = 0
        self.modified = False
        self._steps: asyncio.Queue[_Step] = asyncio.Queue()
        self._tensors: list[TensorInfo] = []  # what the batches named (as far as they parse)
        self._bytes = 0

    @property
    def op(self) -> UpdateOperation | None:
        """The round's Operation, once WeightUpdates.start started it."""
        return self._op

    def started(self, op: UpdateOperation) -> None:
        """The round runs as `op`: the trainer's steps wait on it."""
        self._op = op

    @property
    def receives(self) -> bool:
        return False  # the Operation shows LOADING: each step's answer is the workers' own

    # --- the trainer's side (RPC handlers) ---------------------------------------------------

    async def update(self, payload: Any) -> int:
        """One batch, run on every worker; the batches so far, or the round's error."""
        return int(await self._put(_Step(TransferStep.UPDATE, payload)))

    async def finish(self, version: tuple[bool, str | None]) -> None:
        """The finish (with the version to declare, if given); the round then records."""
        await self._put(_Step(TransferStep.FINISH, version))

    def abort(self, cause: str, message: str) -> None:
        """CancelOperation or shutdown: the round ends with `cause`."""
        self._steps.put_nowait(_Step(TransferStep.ABORT, (cause, message)))

    async def _put(self, step: _Step) -> Any:
        """Queue `step` for the round and wait for its answer; a round that ended meanwhile
        (a step sent just as it timed out) answers with its error."""
        assert self._op is not None
        self._steps.put_nowait(step)
        ended = asyncio.ensure_future(self._op.finished.wait())
        try:
            await asyncio.wait({step.done, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if step.done.done():
            return step.done.result()
        raise self._op.failure or ControlPlaneError(
            grpc.StatusCode.FAILED_PRECONDITION, Reason.TRANSFER_NOT_STARTED, f"{self._op.name} ended"
        )

    # --- the round, as the update's source (plans.py UpdateSource) ----------------------------

    async def load(self, op: UpdateOperation, plan: UpdatePlan, deadline: float) -> Loaded:
        """The round of an update: the engine writes into the model; the finish may name the
        version the update declares."""
        started = time.monotonic()
        answers, (declared, version) = await self._round(op, deadline, plan.timeout)
        results = [
            LoadResult(a.dp_rank, a.worker_rank, len(self._tensors), self._bytes, True, time.monotonic() - started)
            for a in answers
        ]
        return Loaded(results, declares=declared, version=version)

    async def stage(self, op: UpdateOperation, plan: UpdatePlan, token: str, deadline: float, max_bytes: int) -> Staged:
        """The round of a stage: the engine writes into every worker's staging target (vLLM's
        `set_weight_update_target`: worker/weights/transfer/), never into the model, and
        generation goes on between the steps. The set then holds the tensors the batches
        named, under the finish's version."""
        _, (declared, version) = await self._round(op, deadline, plan.timeout, token, max_bytes)
        return Staged(replace(plan, tensors=list(self._tensors), version=version if declared else plan.version))

    async def failed(self, cause: str) -> None:
        """Nothing to release: the round already ended on the workers (ABORT)."""

    def close(self) -> None:
        """Nothing held: the trainer's steps still waiting got the round's error."""

    async def _round(
        self, op: UpdateOperation, deadline: float, timeout: float, stage_token: str = "", max_bytes: int = 0
    ) -> tuple[list[TransferAnswer], tuple[bool, str | None]]:
        """Start, the trainer's batches, its finish: (the finish's answers, its version)."""
        writes = not stage_token  # a stage writes into the staging target only
        step: _Step | None = None
        try:
            await self._run_step(deadline, TransferStep.START, stage_token or None, writes=False)
            last = "start_weight_update"
            while True:
                step = await self._next(deadline, timeout, last)
                if step.kind == TransferStep.ABORT:
                    cause, message = step.payload
                    raise UpdateFailed(cause, message, modified=self.modified)
                if step.kind == TransferStep.UPDATE:
                    tensors, nbytes = _batch(step.payload)
                    if stage_token and self._bytes + nbytes > max_bytes:
                        raise UpdateFailed(
                            Reason.STAGING_LIMIT_EXCEEDED,
                            f"batch {self.batches + 1} brings the stage to {self._bytes + nbytes} bytes; this "
                            f"server stages at most {max_bytes} (--max-staged-bytes)",
                            modified=False,
                            metadata={"bytes": str(self._bytes + nbytes), "max_staged_bytes": str(max_bytes)},
                        )
                    await self._run_step(
                        deadline, TransferStep.UPDATE, step.payload, writes=writes and not self._applies_at_finish
                    )
                    self.batches += 1
                    self._tensors.extend(tensors)
                    self._bytes += nbytes
                    op.record_done(len(self._tensors), self._bytes)
                    step.done.set_result(self.batches)
                    step, last = None, f"update_weights batch {self.batches}"
                    continue
                answers = await self._run_step(deadline, TransferStep.FINISH, None, writes=writes)
                step.done.set_result(None)
                return answers, step.payload
        except BaseException as exc:
            await self._abort_workers()
            self._fail_pending(step, exc, op.name)
            raise

    async def _next(self, deadline: float, timeout: float, last: str) -> _Step:
        """The trainer's next step, within the step timeout and the round's deadline."""
        left = deadline - time.time()
        wait = min(self.step_timeout, left)
        try:
            return await asyncio.wait_for(self._steps.get(), max(wait, 0.0))
        except asyncio.TimeoutError:
            if wait >= left:
                raise UpdateFailed(
                    Cause.UPDATE_TIMEOUT,
                    f"the round's timeout ({timeout:.3f}s) elapsed waiting for the trainer after {last}",
                    modified=self.modified,
                ) from None
            raise UpdateFailed(
                Cause.TRANSFER_STEP_TIMEOUT,
                f"no update_weights or finish_weight_update within {self.step_timeout:.3f}s after {last}: "
                "the trainer went away or stalled",
                modified=self.modified,
            ) from None

    async def _run_step(self, deadline: float, kind: TransferStep, payload: Any, writes: bool) -> list[TransferAnswer]:
        if writes:
            self.modified = True  # what the engine wrote before a failure is unknown
        timeout = max(deadline - time.time(), 0.0) + LOAD_RPC_GRACE_S
        try:
            answers = await self._engine.transfer(kind, payload, timeout)
        except ControlPlaneError as exc:
            if exc.reason != Reason.WORKER_TIMEOUT:
                raise
            # A worker still in the step when its call's timeout passed: what it wrote is unknown.
            raise UpdateFailed(Cause.WORKER_TIMEOUT, exc.message, modified=self.modified) from None
        failed = [a for a in answers if a.error]
        if failed:
            if all(a.invalid for a in failed) and kind == TransferStep.UPDATE and not self._applies_at_finish:
                self.modified = self.batches > 0  # refused before this batch did anything
            first = failed[0]
            raise UpdateFailed(
                Cause.TRANSFER_FAILED,
                f"{kind.value} failed on worker {first.worker_rank} of rank {first.dp_rank}: {first.error}",
                modified=self.modified,
            )
        return answers

    async def _abort_workers(self) -> None:
        try:
            await self._engine.transfer(TransferStep.ABORT, None, QUICK_RPC_TIMEOUT_S)
        except ControlPlaneError:
            pass  # the engine died or a worker hung: the round's error says what happened first

    def _fail_pending(self, step: _Step | None, exc: BaseException, operation: str) -> None:
        """Every trainer call still waiting gets the round's error."""
        if isinstance(exc, UpdateFailed):
            error = exc.error(operation)
        elif isinstance(exc, ControlPlaneError):
            error = exc
        else:
            error = ControlPlaneError(grpc.StatusCode.INTERNAL, Reason.TRANSFER_FAILED, "the round ended unexpectedly")
        waiting = [step] if step is not None else []
        while not self._steps.empty():
            waiting.append(self._steps.get_nowait())
        for pending in waiting:
            if not pending.done.done():
                pending.done.set_exception(error)


def _batch(payload: Any) -> tuple[list[TensorInfo], int]:
    """The tensors a batch's update info names (vLLM's field names: `names`, `dtype_names`,
    `shapes`; a list of infos, one per worker, names the first's), as far as they parse (the
    engine refuses the rest), and their bytes."""
    infos = payload if isinstance(payload, list) else [payload]
    info = infos[0] if infos and isinstance(infos[0], dict) else {}
    names, kinds, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
    tensors = [
        TensorInfo(str(name), kind, tuple(int(n) for n in shape))
        for name, kind, shape in zip(names, kinds, shapes, strict=False)
        if kind in dtypes.BY_NAME and isinstance(shape, list) and all(isinstance(n, int) for n in shape)
    ]
    return tensors, sum(t.nbytes for t in tensors)
