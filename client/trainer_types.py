"""Plain Python views of the weight-update API, for the trainer client.

Runs wherever the client runs (a trainer process, a notebook); imports neither torch nor
vLLM. Field meanings are those of `enginectl/weights/v1/weight_update_service.proto`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from google.longrunning import operations_pb2

from enginectl.client.client import Connection
from enginectl.client.errors import EnginectlError, from_status
from enginectl.client.types import WeightVersion
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_pb2
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2


def _enum_name(enum: object, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RankProgress:
    """Progress of an update on one data-parallel rank."""

    dp_rank: int
    phase: str
    tensors_done: int
    bytes_done: int


@dataclass(frozen=True)
class UpdateProgress:
    """An update Operation's metadata: where it is (`phase`: "LOADING", "DONE", ...)."""

    phase: str
    source: str
    weight_version: str | None
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    weights_modified: bool
    paused_by_update: bool
    ranks: tuple[RankProgress, ...]

    @classmethod
    def from_proto(cls, msg: pb2.UpdateWeightsMetadata) -> UpdateProgress:
        return cls(
            phase=_enum_name(pb2.UpdatePhase, msg.phase, "UPDATE_PHASE_"),
            source=_enum_name(weight_version_pb2.WeightSource, msg.source, "WEIGHT_SOURCE_"),
            weight_version=msg.weight_version if msg.HasField("weight_version") else None,
            tensors_done=msg.tensors_done,
            tensors_total=msg.tensors_total,
            bytes_done=msg.bytes_done,
            bytes_total=msg.bytes_total,
            weights_modified=msg.weights_modified,
            paused_by_update=msg.paused_by_update,
            ranks=tuple(
                RankProgress(
                    r.dp_rank, _enum_name(pb2.UpdatePhase, r.phase, "UPDATE_PHASE_"), r.tensors_done, r.bytes_done
                )
                for r in msg.ranks
            ),
        )


@dataclass(frozen=True)
class WorkerResult:
    """What an update loaded on one worker of a rank (tensor x pipeline parallel): with tensor
    parallelism every worker is handed every tensor and keeps its own shard of it, so its
    `bytes_loaded` counts the checkpoint's bytes, as its rank's does."""

    worker_rank: int
    tensors_loaded: int
    bytes_loaded: int
    weights_modified: bool
    error_cause: str  # "" unless this worker failed

    @classmethod
    def from_proto(cls, msg: pb2.WorkerLoad) -> WorkerResult:
        return cls(msg.worker_rank, msg.tensors_loaded, msg.bytes_loaded, msg.weights_modified, msg.error_cause)


@dataclass(frozen=True)
class RankResult:
    """What an update loaded on one data-parallel rank: what every worker of it loaded, and
    each worker's own result in `workers`."""

    dp_rank: int
    tensors_loaded: int
    bytes_loaded: int
    duration: float
    workers: tuple[WorkerResult, ...] = ()


@dataclass(frozen=True)
class StagedWeights:
    """A staged set (two-phase update): received, not applied. Commit it with
    `commit_staged_weights(name)`, drop it with `discard_staged_weights(name)`."""

    name: str
    operation: str
    source: str
    weight_version: str | None
    tensors: int
    bytes: int
    fingerprint: str  # digest of the staged bytes: equal on servers that staged the same tensors
    fingerprint_method: str
    expire_time: datetime | None
    stage_time: datetime | None = None  # when staging completed
    staged_by: str = ""  # who started the stage: its address and user agent (a name, not a proof)

    @classmethod
    def from_proto(cls, msg: pb2.StagedWeights) -> StagedWeights:
        return cls(
            name=msg.name,
            operation=msg.operation,
            source=_enum_name(weight_version_pb2.WeightSource, msg.source, "WEIGHT_SOURCE_"),
            weight_version=msg.weight_version if msg.HasField("weight_version") else None,
            tensors=msg.tensors,
            bytes=msg.bytes,
            fingerprint=msg.fingerprint.digest,
            fingerprint_method=msg.fingerprint.method,
            expire_time=msg.expire_time.ToDatetime(tzinfo=timezone.utc) if msg.HasField("expire_time") else None,
            stage_time=msg.stage_time.ToDatetime(tzinfo=timezone.utc) if msg.HasField("stage_time") else None,
            staged_by=msg.staged_by,
        )


@dataclass(frozen=True)
class UpdateResult:
    """A successful update: the WeightVersion after it, per-rank results, pause facts."""

    operation: str
    weight_version: WeightVersion
    ranks: tuple[RankResult, ...]
    num_paused_requests: int
    num_aborted_requests: int
    prefix_cache_reset: bool
    generation_resumed: bool
    pause_duration: float
    duration: float
    staged: StagedWeights | None = None  # a stage_only update: the set it left

    @classmethod
    def from_proto(cls, operation: str, msg: pb2.UpdateWeightsResponse) -> UpdateResult:
        return cls(
            operation=operation,
            weight_version=WeightVersion.from_proto(msg.weight_version),
            ranks=tuple(
                RankResult(
                    r.dp_rank,
                    r.tensors_loaded,
                    r.bytes_loaded,
                    r.duration.ToTimedelta().total_seconds(),
                    tuple(WorkerResult.from_proto(w) for w in r.workers),
                )
                for r in msg.ranks
            ),
            num_paused_requests=msg.num_paused_requests,
            num_aborted_requests=msg.num_aborted_requests,
            prefix_cache_reset=msg.prefix_cache_reset,
            generation_resumed=msg.generation_resumed,
            pause_duration=msg.pause_duration.ToTimedelta().total_seconds(),
            duration=msg.duration.ToTimedelta().total_seconds(),
            staged=StagedWeights.from_proto(msg.staged) if msg.HasField("staged") else None,
        )


@dataclass(frozen=True)
class UpdateOperation:
    """A weight-update Operation as last read: running (`done` False), succeeded or failed."""

    name: str
    done: bool
    progress: UpdateProgress
    response: UpdateResult | None
    error: EnginectlError | None

    @classmethod
    def from_proto(cls, op: operations_pb2.Operation) -> UpdateOperation:
        metadata = pb2.UpdateWeightsMetadata()
        op.metadata.Unpack(metadata)
        response = error = None
        if op.HasField("error"):
            error = from_status(op.error)
        elif op.HasField("response"):
            msg = pb2.UpdateWeightsResponse()
            op.response.Unpack(msg)
            response = UpdateResult.from_proto(op.name, msg)
        return cls(op.name, op.done, UpdateProgress.from_proto(metadata), response, error)

    def result(self) -> UpdateResult:
        """The result; raises the Operation's error, or RuntimeError while it still runs."""
        if self.error is not None:
            raise self.error
        if self.response is None:
            raise RuntimeError(f"{self.name} has not finished (phase {self.progress.phase})")
        return self.response


@dataclass(frozen=True)
class RankGenerationState:
    """Generation state of one data-parallel rank."""

    dp_rank: int
    paused: bool
    num_running_requests: int
    num_waiting_requests: int


@dataclass(frozen=True)
class GenerationState:
    """Whether generation is paused and why ("CALLER", "UPDATE", "PARTIAL_UPDATE", ...)."""

    paused: bool
    reason: str
    mode: str
    num_running_requests: int
    num_waiting_requests: int
    update_operation: str
    ranks: tuple[RankGenerationState, ...]
    staged: StagedWeights | None = None  # the set waiting for a commit, if any

    @classmethod
    def from_proto(cls, msg: pb2.GenerationState) -> GenerationState:
        return cls(
            paused=msg.paused,
            reason=_enum_name(pb2.PauseReason, msg.reason, "PAUSE_REASON_"),
            mode=_enum_name(pb2.PauseMode, msg.mode, "PAUSE_MODE_"),
            num_running_requests=msg.num_running_requests,
            num_waiting_requests=msg.num_waiting_requests,
            update_operation=msg.update_operation,
            ranks=tuple(
                RankGenerationState(r.dp_rank, r.paused, r.num_running_requests, r.num_waiting_requests)
                for r in msg.ranks
            ),
            staged=StagedWeights.from_proto(msg.staged) if msg.HasField("staged") else None,
        )


@dataclass(frozen=True)
class PauseResult:
    """What PauseGeneration did."""

    state: GenerationState
    was_paused: bool
    num_aborted_requests: int
    num_paused_requests: int
    pause_duration: float

    @classmethod
    def from_proto(cls, msg: pb2.PauseGenerationResponse) -> PauseResult:
        return cls(
            GenerationState.from_proto(msg.state),
            msg.was_paused,
            msg.num_aborted_requests,
            msg.num_paused_requests,
            msg.pause_duration.ToTimedelta().total_seconds(),
        )


@dataclass(frozen=True)
class RankInfo:
    """One data-parallel rank as the server's start-up census found it (docs/multinode.md)."""

    dp_rank: int
    host: str
    local: bool  # on the server's host
    enginectl_version: str
    num_workers: int
    enginectl_scheduler: bool
    host_id: str = ""  # opaque id of its host and boot (common/host.py); "" from an older server


@dataclass(frozen=True)
class ServerInfo:
    """What GetServerInfo says about the server (the fields a trainer needs)."""

    model: str
    served_model_names: tuple[str, ...]
    dtype: str
    data_parallel_size: int
    tensor_parallel_size: int
    num_workers: int
    backends: tuple[str, ...]
    auth_required: bool
    fingerprint_method: str
    allowed_weight_roots: tuple[str, ...]
    max_chunk_bytes: int
    incarnation: str
    supported_rpcs: tuple[str, ...]
    max_staged_bytes: int = 0  # two-phase updates: the largest staged set (0: not offered)
    staged_ttl: float = 0.0  # seconds a staged set is kept
    ranks: tuple[RankInfo, ...] = ()  # every DP rank it manages: where it runs
    # The DP ranks this server manages, by their engine-wide numbers: all `data_parallel_size`
    # of them, or under hybrid load balancing its node's (docs/multinode.md, "One server per node").
    managed_ranks: range = range(0)
    engine_id: str = ""  # equal on every server of one engine ("" from an older server)

    @classmethod
    def from_proto(cls, msg: pb2.GetServerInfoResponse) -> ServerInfo:
        return cls(
            model=msg.model,
            served_model_names=tuple(msg.served_model_names),
            dtype=_enum_name(pb2.TensorDtype, msg.dtype, "TENSOR_DTYPE_").lower(),
            data_parallel_size=msg.data_parallel_size,
            tensor_parallel_size=msg.tensor_parallel_size,
            num_workers=msg.num_workers,
            backends=tuple(_enum_name(pb2.UpdateBackend, b, "UPDATE_BACKEND_") for b in msg.backends),
            auth_required=msg.auth_required,
            fingerprint_method=msg.fingerprint_method,
            allowed_weight_roots=tuple(msg.allowed_weight_roots),
            max_chunk_bytes=msg.limits.max_chunk_bytes or 4 * 1024 * 1024,
            incarnation=msg.incarnation,
            supported_rpcs=tuple(msg.supported_rpcs),
            max_staged_bytes=msg.staging.max_staged_bytes,
            staged_ttl=msg.staging.ttl.ToTimedelta().total_seconds(),
            ranks=tuple(
                RankInfo(
                    r.dp_rank, r.host, r.local, r.enginectl_version, r.num_workers, r.enginectl_scheduler, r.host_id
                )
                for r in msg.ranks
            ),
            managed_ranks=(
                range(msg.managed_ranks.start, msg.managed_ranks.start + msg.managed_ranks.count)
                if msg.managed_ranks.count
                else range(msg.data_parallel_size)  # a server before managed_ranks: every rank
            ),
            engine_id=msg.engine_id or msg.incarnation,
        )


@dataclass(frozen=True)
class WorkerVerification:
    """VerifyWeights on one worker of a rank: its own shard's digests."""

    worker_rank: int
    verdict: str
    recorded_digest: str
    current_digest: str


@dataclass(frozen=True)
class RankVerification:
    """VerifyWeights on one data-parallel rank; `workers` names the worker whose shard differs."""

    dp_rank: int
    verdict: str
    recorded_digest: str
    current_digest: str
    workers: tuple[WorkerVerification, ...] = ()


@dataclass(frozen=True)
class Verification:
    """VerifyWeights: "MATCH", "DRIFTED" or "UNDECLARED", per rank, with the resource."""

    verdict: str
    method: str
    ranks: tuple[RankVerification, ...]
    weight_version: WeightVersion

    @classmethod
    def from_proto(cls, msg: wv_pb2.VerifyWeightsResponse) -> Verification:
        return cls(
            verdict=_enum_name(wv_pb2.VerifyVerdict, msg.verdict, "VERIFY_VERDICT_"),
            method=msg.method,
            ranks=tuple(
                RankVerification(
                    r.dp_rank,
                    _enum_name(wv_pb2.VerifyVerdict, r.verdict, "VERIFY_VERDICT_"),
                    r.recorded_digest,
                    r.current_digest,
                    tuple(
                        WorkerVerification(
                            w.worker_rank,
                            _enum_name(wv_pb2.VerifyVerdict, w.verdict, "VERIFY_VERDICT_"),
                            w.recorded_digest,
                            w.current_digest,
                        )
                        for w in r.workers
                    ),
                )
                for r in msg.ranks
            ),
            weight_version=WeightVersion.from_proto(msg.weight_version),
        )


@dataclass(frozen=True)
class WeightsUpdateGroup:
    """A group made by init_weights_update_group; the trainer is rank 0."""

    group_name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    num_engine_ranks: int


class TrainerCalls(Protocol):
    """What the trainer's helpers (trainer_broadcast.py, trainer_ipc.py) call back on the
    trainer that holds them: AsyncTrainerClient (trainer.py), named by this type so that no
    helper imports the trainer it serves."""

    connection: Connection

    async def get_server_info(self, *, timeout: float | None = None) -> ServerInfo: ...

    async def wait_operation(
        self, name: str, timeout: float | None = None, *, progress: bool = False
    ) -> UpdateOperation: ...
