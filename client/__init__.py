"""enginectl client: typed access to the enginectl API. Needs neither torch nor vLLM.

from enginectl.client import Client
with Client("127.0.0.1:50051") as c:
    c.set_weight_version("step-42")
    print(c.get_weight_version())
"""

from enginectl.client.client import AsyncClient, ChannelConfig, Client
from enginectl.client.errors import (
    AbortedError,
    DeadlineExceededError,
    EnginectlError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    Reason,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from enginectl.client.fleet import AsyncFleet, Fleet
from enginectl.client.fleet_types import (
    FleetCommit,
    FleetCommitError,
    FleetError,
    FleetStage,
    FleetStageError,
    FleetStatus,
    ServerOutcome,
    ServerStatus,
)
from enginectl.client.fpm import FpmBatch, FpmGenerationState, FpmProgress, FpmSample, SampleKind
from enginectl.client.planner import (
    EndpointStatus,
    FleetView,
    Planner,
    PlannerThread,
    RankState,
    Reconciliation,
    Verdict,
)
from enginectl.client.progress import ProgressBar
from enginectl.client.rollouts import GenerationVersions, generation_versions
from enginectl.client.trainer import AsyncBroadcast, AsyncTrainerClient, Broadcast, TrainerClient
from enginectl.client.trainer_types import (
    GenerationState,
    PauseResult,
    ServerInfo,
    StagedWeights,
    UpdateOperation,
    UpdateProgress,
    UpdateResult,
    Verification,
    WeightsUpdateGroup,
)
from enginectl.client.types import (
    IdentityAcks,
    RankIdentity,
    UpdateFailure,
    WeightSource,
    WeightVersion,
    WorkerIdentity,
)

__all__ = [
    "AbortedError",
    "AsyncBroadcast",
    "AsyncFleet",
    "Fleet",
    "FleetCommit",
    "FleetCommitError",
    "FleetError",
    "FleetStage",
    "FleetStageError",
    "FleetStatus",
    "ServerOutcome",
    "ServerStatus",
    "AsyncClient",
    "AsyncTrainerClient",
    "Broadcast",
    "ChannelConfig",
    "Client",
    "DeadlineExceededError",
    "EndpointStatus",
    "EnginectlError",
    "FailedPreconditionError",
    "FieldViolation",
    "FleetView",
    "FpmBatch",
    "FpmGenerationState",
    "FpmProgress",
    "FpmSample",
    "GenerationState",
    "GenerationVersions",
    "IdentityAcks",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PauseResult",
    "Planner",
    "PlannerThread",
    "ProgressBar",
    "RankIdentity",
    "RankState",
    "Reason",
    "Reconciliation",
    "SampleKind",
    "ServerInfo",
    "TrainerClient",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UpdateFailure",
    "UpdateOperation",
    "UpdateProgress",
    "StagedWeights",
    "UpdateResult",
    "Verdict",
    "Verification",
    "WeightSource",
    "WeightVersion",
    "WeightsUpdateGroup",
    "WorkerIdentity",
    "generation_versions",
]
