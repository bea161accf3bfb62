"""WeightTransfer: vLLM's weight-transfer engines driven as enginectl updates.

Runs in the `enginectl serve` process, on the control loop. The server was started with vLLM's
`--weight-transfer-config`; the engine it names moves the bytes, and this module gives its four
steps the rules of every update (docs/weights.md, "vLLM's weight-transfer engines"):

- `init` runs the engine's init on every worker (once per trainer connection);
- `start` validates a round as every update (version, etag, request_id, pause mode, timeout)
  and starts it through WeightUpdates.start: one update at a time, the ledger's write lock,
  the pause (KEEP by default). The round is an UpdateRun (run.py) whose load is
  `TransferRound.load`: the engine's start, then the trainer's batches and its finish, each
  waited for within the step timeout and the round's deadline, each run on every worker
  (WorkerRpc.TRANSFER, worker/weights/transfer_steps.py);
- after the finish the run goes on as any update: cache reset, version recorded through the
  ledger, resume, fingerprint. A failure ends the round on the workers (ABORT) and follows
  the partial rule: once the engine may have written into the model (any batch of an engine
  that loads as it receives; the finish of one that applies at its finish, as enginectl's
  `gloo`), the version is undeclared, generation stays paused and the server is quarantined.
- a `stage_only` start (engines in STAGES) runs the same steps as a stage instead
  (`TransferRound.stage`, through Staging.run_round): no pause, no ledger lock; START carries
  the set's token, and every worker points the engine's weight-update target at its staging
  buffer (worker/weights/transfer_staging.py). The finish leaves a staged set that
  CommitStagedWeights applies as any other.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format

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
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.weights.convert import parse_timeout
from enginectl.server.weights.disk import TensorInfo
from enginectl.server.weights.engine_protocols import TransferEngine
from enginectl.server.weights.operations import UpdateOperation
from enginectl.server.weights.outcome import UpdateFailed
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.server.weights.run import UpdateRun
    from enginectl.server.weights.staging import StagedSet
    from enginectl.server.weights.updates import WeightUpdates

# Engines that touch the model only in their finish (a failed batch leaves it whole).
APPLIES_AT_FINISH = frozenset({GLOO_TRANSFER_BACKEND})
# Engines whose rounds can stage (`stage_only`): they write through vLLM's weight-update target
# (set_weight_update_target), which a stage points at the workers' staging buffers. vLLM's own
# engines open its layerwise reload on the target, which a staging buffer is not.
STAGES = frozenset({GLOO_TRANSFER_BACKEND})
INIT_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 60.0  # default longest wait for the trainer's next step (a batch, the finish)


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
        self.op: UpdateOperation | None = None
        self.batches = 0
        self.modified = False
        self._steps: asyncio.Queue[_Step] = asyncio.Queue()
        self._tensors: list[TensorInfo] = []  # what the batches named (as far as they parse)
        self._bytes = 0

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
        assert self.op is not None
        self._steps.put_nowait(step)
        ended = asyncio.ensure_future(self.op.finished.wait())
        try:
            await asyncio.wait({step.done, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if step.done.done():
            return step.done.result()
        raise self.op.failure or ControlPlaneError(
            grpc.StatusCode.FAILED_PRECONDITION, Reason.TRANSFER_NOT_STARTED, f"{self.op.name} ended"
        )

    # --- the round (UpdateRun's load) --------------------------------------------------------

    async def load(self, run: UpdateRun) -> list[LoadResult]:
        """The round of an update: the engine writes into the model."""
        run.op.on_abort = self.abort
        started = time.monotonic()
        answers, (declared, version) = await self._round(run.op, run.deadline, run.plan.timeout)
        if declared:
            run.plan = replace(run.plan, version=version)
        return [
            LoadResult(a.dp_rank, a.worker_rank, len(self._tensors), self._bytes, True, time.monotonic() - started)
            for a in answers
        ]

    async def stage(self, staged: StagedSet, op: UpdateOperation, deadline: float, max_bytes: int) -> None:
        """The round of a stage (Staging.run_round): the engine writes into every worker's
        staging target (vLLM's `set_weight_update_target`: worker/weights/transfer_staging.py),
        never into the model, and generation goes on between the steps. The set then holds
        the tensors the batches named, under the finish's version."""
        op.on_abort = self.abort
        _, (declared, version) = await self._round(op, deadline, staged.plan.timeout, staged.token, max_bytes)
        staged.plan = replace(
            staged.plan, tensors=list(self._tensors), version=version if declared else staged.plan.version
        )

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
                    op.metadata.tensors_done, op.metadata.bytes_done = len(self._tensors), self._bytes
                    op.touch()
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


class WeightTransfer:
    """The transfer engine of this server, and its open round (module docstring)."""

    def __init__(self, engine: TransferEngine, updates: WeightUpdates, backend: str | None) -> None:
        self._engine = engine
        self._updates = updates
        self.backend = backend
        self.initialized = False
        self._round: TransferRound | None = None

    def _configured(self) -> str:
        if self.backend is None:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.TRANSFER_NOT_CONFIGURED,
                "this server runs no weight-transfer engine: start it with "
                "--weight-transfer-config '{\"backend\": ...}'",
            )
        return self.backend

    def _open(self, name: str) -> TransferRound:
        self._configured()
        found = self._round
        if found is None or found.op is None or found.op.done or (name and name != found.op.name):
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.TRANSFER_NOT_STARTED,
                "no open round" + (f" named {name!r}" if name else "") + ": call start_weight_update first",
            )
        return found

    def _open_round(self) -> bool:
        """A round (an update's or a stage's) has not ended."""
        return self._round is not None and self._round.op is not None and not self._round.op.done

    def _busy(self, why: str) -> ControlPlaneError:
        """UPDATE_IN_PROGRESS, naming the open round (a stage's round pauses nothing, so
        Generation does not know it)."""
        assert self._round is not None and self._round.op is not None
        name = self._round.op.name
        return ControlPlaneError(
            grpc.StatusCode.ABORTED,
            Reason.UPDATE_IN_PROGRESS,
            f"{name} is running; {why}",
            metadata={"operation": name},
        )

    async def init(self, request: pb2.InitWeightTransferEngineRequest) -> pb2.InitWeightTransferEngineResponse:
        backend = self._configured()
        if self.initialized:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.TRANSFER_ALREADY_INITIALIZED,
                "the transfer engine is initialized: call shutdown_weight_transfer_engine first",
            )
        if self._open_round():
            raise self._busy("a transfer round is open")
        if self._updates.generation.updating():
            raise self._updates.generation.in_progress("an update runs")
        timeout = parse_timeout("timeout", request.timeout, request.HasField("timeout"), INIT_TIMEOUT_S)
        info = plain(json_format.MessageToDict(request.init_info))
        answers = await self._engine.transfer(TransferStep.INIT, info, timeout + LOAD_RPC_GRACE_S)
        failed = [a for a in answers if a.error]
        if failed:
            await self._engine.transfer(TransferStep.SHUTDOWN, None, QUICK_RPC_TIMEOUT_S)  # the workers that joined
            first = failed[0]
            if all(a.invalid for a in failed):
                raise invalid_field(Reason.TRANSFER_INIT_INVALID, "init_info", first.error)
            raise ControlPlaneError(
                grpc.StatusCode.INTERNAL,
                Reason.TRANSFER_INIT_FAILED,
                f"worker {first.worker_rank} of rank {first.dp_rank}: {first.error}",
            )
        self.initialized = True
        return pb2.InitWeightTransferEngineResponse(backend=backend, num_workers=len(answers))

    async def start(self, request: pb2.StartWeightUpdateRequest) -> UpdateOperation:
        backend = self._configured()
        if request.stage_only and backend not in STAGES:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.STAGE_UNSUPPORTED,
                f"the {backend!r} transfer engine can not stage: it loads each batch into the model as it "
                f"arrives (engines that stage: {', '.join(sorted(STAGES))})",
            )
        plan = self._updates.validator.transfer(request)
        step_timeout = parse_timeout(
            "step_timeout", request.step_timeout, request.HasField("step_timeout"), min(plan.timeout, STEP_TIMEOUT_S)
        )
        if not self.initialized:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.TRANSFER_NOT_INITIALIZED,
                "call init_weight_transfer_engine first",
            )
        round_ = TransferRound(self._engine, backend, step_timeout)
        op, started = await self._updates.start(plan, loader=round_.load, stager=round_.stage)
        if started:
            round_.op = op
            self._round = round_
        return op

    async def update(self, request: pb2.UpdateWeightsRequest) -> pb2.UpdateWeightsBatchResponse:
        round_ = self._open(request.name)
        info: Any = {}
        if request.update_info_json:  # its integers exact; update_info's numbers are doubles
            try:
                info = json.loads(request.update_info_json)
            except ValueError as err:
                raise invalid_field(Reason.MALFORMED_REQUEST, "update_info_json", f"not JSON: {err}") from None
        elif request.HasField("update_info"):
            info = json_format.MessageToDict(request.update_info)
        payload = plain(info)
        return pb2.UpdateWeightsBatchResponse(batches=await round_.update(payload))

    async def finish(self, request: pb2.FinishWeightUpdateRequest) -> UpdateOperation:
        round_ = self._open(request.name)
        declared = request.HasField("weight_version")
        self._updates.check_version(request.weight_version if declared else None, request.etag)
        await round_.finish((declared, request.weight_version if declared else None))
        assert round_.op is not None
        await round_.op.finished.wait()
        return round_.op

    async def shutdown(
        self, request: pb2.ShutdownWeightTransferEngineRequest
    ) -> pb2.ShutdownWeightTransferEngineResponse:
        self._configured()
        if self._open_round():
            raise self._busy("a transfer round is open")
        found, self.initialized = self.initialized, False
        answers = await self._engine.transfer(TransferStep.SHUTDOWN, None, QUICK_RPC_TIMEOUT_S)
        failed = [a for a in answers if a.error]
        if failed:
            raise ControlPlaneError(grpc.StatusCode.INTERNAL, Reason.TRANSFER_FAILED, failed[0].error)
        return pb2.ShutdownWeightTransferEngineResponse(found=found)


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


def plain(value: Any) -> Any:
    """A JSON value from protobuf's Struct with its integers back: Struct holds every number
    as a double, and vLLM's engines check ports, ranks and shapes as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
