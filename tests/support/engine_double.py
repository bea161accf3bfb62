"""An in-memory engine for unit tests of the update state machine (server/weights/).

It implements the typed EngineAdapter methods WeightUpdates calls (`UpdateEngine`, in
server/weights/engine_protocols.py) over a few fields, and records every call, so tests of
pure logic (pause modes, auto-pause and resume, one update at a time, the partial-update rule,
ordering with a declaration) run without vLLM. The real-engine tests (tests/e2e/) cover the
same rules end to end; this double only stands in for speed and for states that are hard to
reach on purpose (a load that fails after writing, a load held mid-way, a transfer engine that
writes as it receives, which only a GPU runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from enginectl.contract.engine import (
    Cause,
    DigestJob,
    DigestSlice,
    FinishUpdate,
    LoadCheck,
    LoadError,
    LoadPlan,
    LoadResult,
    PauseReason,
    RankGenerationState,
    TransferAnswer,
    TransferStep,
    WorkerDigest,
)
from enginectl.contract.groups import GroupJoined, GroupSpec
from enginectl.contract.prepare import Prepared, PreparePlan
from enginectl.server.engine_info import EngineInfo
from enginectl.server.worker_calls import RankOutcome
from enginectl.worker.weights.prepare import prepare


@dataclass
class LoadScript:
    """How the next load ends: `error` (None: success), whether weights were written, and
    an event it waits for first (None: answer at once)."""

    error: Cause | None = None
    modified: bool = True
    release: asyncio.Event | None = None
    not_finite: str = ""  # what the check after the load names as computing NaN ("": none)
    mismatch_layer: str = ""  # what it names as not computing with what was written ("": none)


@dataclass
class EngineDouble:
    """One DP rank whose weights are a version string; every call appended to `calls`."""

    running: int = 0
    waiting: int = 0
    paused: bool = False
    holder: PauseReason | None = None  # who holds the pause, as the last PAUSE or HOLD named it
    weights: str = "A"  # what is "loaded": the digest is derived from it
    version: str | None = None  # stamped on outputs
    calls: list[str] = field(default_factory=list)
    finished_with: FinishUpdate | None = None  # the last FINISH_UPDATE request
    script: LoadScript = field(default_factory=LoadScript)
    loading: asyncio.Event = field(default_factory=asyncio.Event)  # set once a load began
    drained: asyncio.Event | None = None  # a WAIT pause waits for it (None: drains at once)
    draining: asyncio.Event = field(default_factory=asyncio.Event)  # set once a WAIT pause waits
    info: EngineInfo = field(
        default_factory=lambda: EngineInfo(
            model="double",
            served_model_names=("double",),
            dtype="float32",
            quantization="",
            data_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            vllm_version="0.32.0",
        )
    )
    errored: bool = False
    transfer_failures: dict[TransferStep, str] = field(default_factory=dict)  # step -> its error
    transfer_refusals: dict[TransferStep, str] = field(default_factory=dict)  # step -> its parse error
    transfer_writes_before_failing: bool = True

    # --- generation --------------------------------------------------------------------

    async def generation_state(self) -> list[RankGenerationState]:
        return [RankGenerationState(0, self.paused, self.running, self.waiting)]

    async def is_paused(self) -> list[bool]:
        return [self.paused]

    async def pause(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause:{mode}")
        if mode == "abort":
            self.running = self.waiting = 0
        self.paused = True
        if mode == "wait" and self.drained is not None:  # WAIT: answers once requests drained
            self.draining.set()
            await self.drained.wait()

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def pause_reporting(
        self, mode: str, clear_cache: bool, reason: PauseReason = PauseReason.CALLER, if_running: bool = False
    ) -> list[RankGenerationState]:
        before = await self.generation_state()
        if if_running and self.paused:
            return before
        await self.pause(mode, clear_cache)
        self.holder = reason
        return before

    async def hold(self, reason: PauseReason) -> None:
        if self.paused:
            self.holder = reason

    async def resume_reporting(self) -> list[RankGenerationState]:
        before = await self.generation_state()
        await self.resume()
        return before

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def set_weight_version(self, version: str) -> None:
        self.calls.append(f"set_weight_version:{version}")
        self.version = version

    # --- weights -----------------------------------------------------------------------

    async def prepare(self, plan: PreparePlan) -> list[Prepared]:
        """The real worker-side check (worker/weights/prepare.py), on this host's files."""
        self.calls.append("prepare")
        return [prepare(plan, 0, 0)]

    async def load(self, plan: LoadPlan, timeout: float) -> list[LoadResult]:
        self.calls.append("load")
        self.loading.set()
        script = self.script
        if script.release is not None:
            await script.release.wait()
        if script.modified:
            self.weights = "+".join(t.name for t in plan.tensors)
        error = LoadError(script.error, "scripted failure") if script.error is not None else None
        return [LoadResult(0, 0, len(plan.tensors) if error is None else 0, 0, script.modified, 0.01, error)]

    async def transfer(self, step: TransferStep, payload: object, timeout: float) -> list[TransferAnswer]:
        """A transfer step (server/weights/transfer.py): refused with `transfer_refusals[step]`,
        or fails with `transfer_failures[step]`, where set; an UPDATE or FINISH that runs
        changes the weights."""
        self.calls.append(f"transfer:{step.value}")
        if step in self.transfer_refusals:  # the worker's parse refused it: nothing done
            return [TransferAnswer(0, 0, self.transfer_refusals[step], True)]
        error = self.transfer_failures.get(step, "")
        if step in (TransferStep.UPDATE, TransferStep.FINISH) and (not error or self.transfer_writes_before_failing):
            self.weights = f"transfer-{step.value}"
        return [TransferAnswer(0, 0, error)]

    async def finish_update(self, request: FinishUpdate) -> list[list[WorkerDigest]]:
        self.calls.append(f"finish_update:resume={request.resume}")
        self.finished_with = request
        if request.version is not None:
            self.version = request.version
        if request.resume:
            self.paused = False
        return [[self._digest()] if request.fingerprint_token else []]

    async def check_loaded(self, clear_kv: bool) -> list[LoadCheck]:
        self.calls.append("check_loaded" + (" clear_kv" if clear_kv else ""))
        script = self.script
        why = "its kernel differs from the weight it was written" if script.mismatch_layer else ""
        return [LoadCheck(0, 0, 0.0, 1 if clear_kv else 0, script.not_finite, script.mismatch_layer, why)]

    async def fingerprint(self) -> list[list[WorkerDigest]]:
        return [[self._digest()]]

    async def declare_fingerprint(self, token: str) -> list[list[WorkerDigest]]:
        return [[self._digest()]]

    async def full_digest(self, job: DigestJob, token: str) -> list[list[DigestSlice]]:
        return [[DigestSlice(0, 0, done=True, digest=f"full-{self.weights}", method="full")]]

    def _digest(self) -> WorkerDigest:
        return WorkerDigest(0, 0, f"sampled-{self.weights}", "sampled", "sampled", "full")

    # --- groups ------------------------------------------------------------------------

    async def init_group(self, spec: GroupSpec, timeout: float) -> list[RankOutcome[list[GroupJoined]]]:
        return [RankOutcome(0, [GroupJoined(0, spec.rank_offset)])]

    async def group_join_state(self, name: str, timeout: float) -> list[RankOutcome[list[GroupJoined]]]:
        return [RankOutcome(0, [GroupJoined(0, 1)])]

    async def destroy_group(self, name: str) -> None:
        self.calls.append(f"destroy_group:{name}")
