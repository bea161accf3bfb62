"""What the weights room needs of the engine: a Protocol per core, and UpdateEngine, their union.

Runs in the `enginectl serve` process. server/engine.py's EngineAdapter implements them, and so
does the in-memory double of tests/support/engine_double.py. They live apart from the cores
that use them so that every core (updates.py and the run, staging and groups it is made
of) names the engine it needs without importing another core.
"""

from __future__ import annotations

from typing import Any, Protocol

from enginectl.contract.engine import (
    DigestJob,
    DigestSlice,
    FinishUpdate,
    LoadCheck,
    LoadPlan,
    LoadResult,
    PauseReason,
    RankGenerationState,
    StageAck,
    StageResult,
    TransferAnswer,
    TransferStep,
    WorkerDigest,
)
from enginectl.contract.groups import GroupJoined, GroupSpec
from enginectl.contract.prepare import Prepared, PreparePlan
from enginectl.server.engine_info import EngineInfo
from enginectl.server.worker_calls import RankOutcome


class PauseEngine(Protocol):
    """What Generation (generation.py) and its pause paths (pause_paths.py) need of the engine."""

    async def generation_state(self) -> list[RankGenerationState]: ...

    async def is_paused(self) -> list[bool]: ...

    async def pause(self, mode: str, clear_cache: bool) -> None: ...

    async def resume(self) -> None: ...

    async def pause_reporting(
        self, mode: str, clear_cache: bool, reason: PauseReason = PauseReason.CALLER, if_running: bool = False
    ) -> list[RankGenerationState]: ...

    async def hold(self, reason: PauseReason) -> None: ...

    async def resume_reporting(self) -> list[RankGenerationState]: ...

    async def finish_update(self, request: FinishUpdate) -> list[list[WorkerDigest]]: ...

    async def reset_prefix_cache(self) -> None: ...

    @property
    def errored(self) -> bool: ...


class GroupEngine(Protocol):
    """What UpdateGroups (groups.py) needs of the engine."""

    info: EngineInfo

    async def init_group(self, spec: GroupSpec, timeout: float) -> list[RankOutcome[list[GroupJoined]]]: ...

    async def group_join_state(self, name: str, timeout: float) -> list[RankOutcome[list[GroupJoined]]]: ...

    async def destroy_group(self, name: str) -> None: ...


class FingerprintEngine(Protocol):
    """What WeightFingerprints (fingerprints.py) needs of the engine."""

    async def fingerprint(self) -> list[list[WorkerDigest]]: ...

    async def declare_fingerprint(self, token: str) -> list[list[WorkerDigest]]: ...

    async def full_digest(self, job: DigestJob, token: str) -> list[list[DigestSlice]]: ...


class StagingEngine(Protocol):
    """What Staging (staging.py) needs of the engine."""

    async def stage(self, plan: LoadPlan) -> list[list[StageAck]]: ...

    async def stage_result(self, token: str) -> list[list[StageResult]]: ...

    async def discard_staged(self, token: str, free: bool) -> int: ...


class UpdateEngine(PauseEngine, GroupEngine, FingerprintEngine, StagingEngine, Protocol):
    """What weight updates need of the engine (WeightUpdates in updates.py, and each update's
    UpdateRun in run.py)."""

    info: EngineInfo

    async def prepare(self, plan: PreparePlan) -> list[Prepared]: ...

    async def load(self, plan: LoadPlan, timeout: float) -> list[LoadResult]: ...

    async def check_loaded(self, clear_kv: bool) -> list[LoadCheck]: ...

    async def set_weight_version(self, version: str) -> None: ...


class TransferEngine(Protocol):
    """A step of vLLM's weight-transfer API on every worker (transfer.py)."""

    @property
    def info(self) -> EngineInfo: ...

    async def transfer(self, step: TransferStep, payload: Any, timeout: float) -> list[TransferAnswer]: ...
