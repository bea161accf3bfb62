"""WeightTransfer: vLLM's weight-transfer engines driven as enginectl updates.

Runs in the `enginectl serve` process, on the control loop. The server was started with vLLM's
`--weight-transfer-config`; the engine it names moves the bytes, and this module gives its four
steps the rules of every update (docs/weights.md, "vLLM's weight-transfer engines"):

- `init` runs the engine's init on every worker (once per trainer connection). An init while
  the engine holds a connection and no round is open is a trainer that restarted taking over,
  as on plain vLLM: every worker parses the new init info first (bad info changes nothing),
  then shuts the old connection down and joins the new one; the takeover is logged with the
  previous init's time and caller, and counted. With a round open, the init is refused and
  names the round, which CancelOperation ends at once (docs/weights.md, "A trainer that
  restarts");
- `start` validates a round as every update (version, etag, request_id, pause mode, timeout)
  and starts it through WeightUpdates.start, the round its source
  (sources/transfer_round.py): one update at a time, the ledger's write lock, the pause (KEEP
  by default), then the round's steps;
- `update` and `finish` hand the trainer's batch and finish to the open round, which runs them
  on every worker (WorkerRpc.TRANSFER, worker/weights/transfer/); after the finish the update
  goes on as any: cache reset, version recorded through the ledger, resume, fingerprint. A
  failure ends the round on the workers (ABORT) and follows the partial rule.
- a `stage_only` start (engines in STAGES) runs the same steps as a stage instead: no pause,
  no ledger lock; the finish leaves a staged set that CommitStagedWeights applies as any other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc
import structlog
from google.protobuf import json_format

from enginectl.contract.engine import GLOO_TRANSFER_BACKEND, LOAD_RPC_GRACE_S, QUICK_RPC_TIMEOUT_S, TransferStep
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.weights.convert import parse_timeout
from enginectl.server.weights.engine_protocols import TransferEngine
from enginectl.server.weights.sources.groups import check_master_reachable
from enginectl.server.weights.sources.transfer_round import STAGES, TransferRound
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.updates import WeightUpdates
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.transfer")

INIT_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 60.0  # default longest wait for the trainer's next step (a batch, the finish)


class WeightTransfer:
    """The transfer engine of this server, and its open round (module docstring)."""

    def __init__(
        self,
        engine: TransferEngine,
        updates: WeightUpdates,
        backend: str | None,
        on_takeover: Callable[[str], None] | None = None,
    ) -> None:
        self._engine = engine
        self._updates = updates
        self.backend = backend
        self.initialized = False
        self._init_time = 0.0  # when the connection in place was made (time.time()), and by whom
        self._init_by = ""
        self._round: TransferRound | None = None
        # Inits (and shutdowns) one at a time: the last one's connection is the engine's, and a
        # takeover always knows whose it ends.
        self._init_lock = asyncio.Lock()
        self._on_takeover = on_takeover  # hears "transfer_engine" on every takeover (the metric)

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

    def _retries_open_round(self, request_id: str) -> bool:
        """A start retried with the open round's request_id (answered its Operation)."""
        assert self._round is not None and self._round.op is not None
        return bool(request_id) and self._round.op.metadata.request_id == request_id

    def _busy(self, why: str) -> ControlPlaneError:
        """UPDATE_IN_PROGRESS, naming the open round (a stage's round pauses nothing, so
        Generation does not know it)."""
        assert self._round is not None and self._round.op is not None
        name = self._round.op.name
        return ControlPlaneError(
            grpc.StatusCode.ABORTED,
            Reason.UPDATE_IN_PROGRESS,
            f"{name} is running; {why}. A trainer taking over ends it first: CancelOperation(name={name!r}) "
            f"ends it at once (else it fails {self._round.step_timeout:.0f}s after the trainer's last step)",
            metadata={"operation": name},
        )

    async def init(
        self, request: pb2.InitWeightTransferEngineRequest, by: str = ""
    ) -> pb2.InitWeightTransferEngineResponse:
        """The engine's init on every worker, for the trainer `by` (a takeover when a
        connection is in place: module docstring)."""
        self._configured()
        async with self._init_lock:
            return await self._init(request, by)

    async def _init(
        self, request: pb2.InitWeightTransferEngineRequest, by: str
    ) -> pb2.InitWeightTransferEngineResponse:
        backend = self._configured()
        if self._open_round():
            raise self._busy("a transfer round is open")
        if self._updates.generation.updating():
            raise self._updates.generation.in_progress("an update runs")
        timeout = parse_timeout("timeout", request.timeout, request.HasField("timeout"), INIT_TIMEOUT_S)
        info = plain(json_format.MessageToDict(request.init_info))
        address = info.get("master_address") if isinstance(info, dict) else None
        if isinstance(address, str) and self._updates.remote_ranks:  # a name may resolve slowly
            await asyncio.to_thread(check_master_reachable, address, self._updates.remote_ranks)
        if backend == GLOO_TRANSFER_BACKEND and isinstance(info, dict):
            # Ranks from this server's first worker on (one server per node: docs/multinode.md).
            info["first_worker"] = self._engine.info.layout.first_worker
        taking_over = self.initialized
        # Each worker parses `info` before it lets an old connection go (worker/weights/transfer/).
        answers = await self._engine.transfer(TransferStep.INIT, info, timeout + LOAD_RPC_GRACE_S)
        failed = [a for a in answers if a.error]
        refused = bool(failed) and all(a.invalid for a in failed)  # by every worker's parse: nothing changed
        if taking_over and not refused:  # the old connection is gone
            self._taken_over(by)
        if refused:
            raise invalid_field(Reason.TRANSFER_INIT_INVALID, "init_info", failed[0].error)
        if failed:
            await self._engine.transfer(TransferStep.SHUTDOWN, None, QUICK_RPC_TIMEOUT_S)  # the workers that joined
            first = failed[0]
            raise ControlPlaneError(
                grpc.StatusCode.INTERNAL,
                Reason.TRANSFER_INIT_FAILED,
                f"worker {first.worker_rank} of rank {first.dp_rank}: {first.error}",
            )
        self.initialized, self._init_time, self._init_by = True, time.time(), by
        return pb2.InitWeightTransferEngineResponse(backend=backend, num_workers=len(answers))

    def _taken_over(self, by: str) -> None:
        """The connection in place was let go for `by`'s: logged with whose it was, counted."""
        self.initialized = False
        log.warning(
            "transfer engine taken over",
            backend=self.backend,
            previous_init_time=datetime.fromtimestamp(self._init_time, UTC).isoformat(),
            previous_caller=self._init_by,
            caller=by,
        )
        if self._on_takeover is not None:
            self._on_takeover("transfer_engine")

    async def start(self, request: pb2.StartWeightUpdateRequest, by: str = "") -> UpdateOperation:
        backend = self._configured()
        if request.stage_only and backend not in STAGES:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.STAGE_UNSUPPORTED,
                f"the {backend!r} transfer engine can not stage: it loads each batch into the model as it "
                f"arrives (engines that stage: {', '.join(sorted(STAGES))})",
            )
        if self._open_round() and not self._retries_open_round(request.request_id):
            raise self._busy("one round at a time")  # two trainers never interleave rounds
        plan = self._updates.validator.transfer(request)
        step_timeout = parse_timeout(
            "step_timeout", request.step_timeout, request.HasField("step_timeout"), min(plan.timeout, STEP_TIMEOUT_S)
        )
        if not self.initialized or self._init_lock.locked():
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.TRANSFER_NOT_INITIALIZED,
                "an init (or shutdown) of the transfer engine is running: start once it answered"
                if self._init_lock.locked()
                else "call init_weight_transfer_engine first",
            )
        round_ = TransferRound(self._engine, backend, step_timeout)
        op, started = await self._updates.start(plan.asked_by(by).arriving_by(round_))
        if started:
            round_.started(op)
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
        async with self._init_lock:
            return await self._shutdown()

    async def _shutdown(self) -> pb2.ShutdownWeightTransferEngineResponse:
        if self._open_round():
            raise self._busy("a transfer round is open")
        found, self.initialized = self.initialized, False
        answers = await self._engine.transfer(TransferStep.SHUTDOWN, None, QUICK_RPC_TIMEOUT_S)
        failed = [a for a in answers if a.error]
        if failed:
            raise ControlPlaneError(grpc.StatusCode.INTERNAL, Reason.TRANSFER_FAILED, failed[0].error)
        return pb2.ShutdownWeightTransferEngineResponse(found=found)


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
