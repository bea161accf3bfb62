"""enginectl's Prometheus metrics (server/metrics.py, docs/metrics.md) as pure code:
WeightUpdates and IdentitySync against in-memory engines (tests/support/engine_double.py),
reporting into a private registry, drive every update result and every pause reason. The same
metrics scraped from a real server, and the dashboard and docs that name them, are in
tests/e2e/test_metrics.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from support.engine_double import EngineDouble, LoadScript

from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import Cause, RankFailure, RankIdentity
from enginectl.server.errors import ControlPlaneError
from enginectl.server.fpm.identity import IdentitySync
from enginectl.server.metrics import ControlPlaneMetrics
from enginectl.server.weights.sources.disk import TensorInfo
from enginectl.server.weights.update.operations import OperationStore, UpdateOperation
from enginectl.server.weights.update.plans import UpdatePlan
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.server.worker_calls import RankOutcome
from enginectl.weights.v1 import weight_update_service_pb2 as upb

WAIT_S = 10.0
TENSOR = TensorInfo("w", "float32", (2, 2))
UPDATE_SECONDS = "enginectl_weight_update_duration_seconds"
PAUSE_SECONDS = "enginectl_generation_pause_seconds"


class Registry:
    """A private registry the metrics report into, read back by sample name and labels."""

    def __init__(self, ledger: WeightVersionLedger) -> None:
        self.registry = CollectorRegistry()
        self.metrics = ControlPlaneMetrics(ledger, registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        assert value is not None, f"{name}{labels} is not exported"
        return value


@pytest.fixture
async def engine() -> EngineDouble:
    return EngineDouble()


@pytest.fixture
async def ledger(engine: EngineDouble) -> WeightVersionLedger:
    return WeightVersionLedger(publish=engine.set_weight_version)


@pytest.fixture
async def exported(ledger: WeightVersionLedger) -> Registry:
    return Registry(ledger)


@pytest.fixture
async def updates(
    engine: EngineDouble, ledger: WeightVersionLedger, exported: Registry
) -> AsyncIterator[WeightUpdates]:
    metrics = exported.metrics
    updates = WeightUpdates(
        engine,
        ledger,
        OperationStore(),
        allowed_roots=[],
        expected={TENSOR.name: TENSOR},
        on_finished=metrics.update_done,
        on_pause=metrics.pause_changed,
    )
    await updates.prepare()
    yield updates
    updates.close()


def plan() -> UpdatePlan:
    return UpdatePlan(WeightSource.TENSORS, [TENSOR], [], "", "v1", "", "", "keep", True, 30.0)


async def finished(updates: WeightUpdates, op: UpdateOperation) -> None:
    await asyncio.wait_for(updates.operations.wait(op, None), WAIT_S)
    assert op.done


async def cancelled_before_loading(updates: WeightUpdates, engine: EngineDouble) -> None:
    """CancelOperation while the update pauses generation (as test_update_state_machine.py)."""
    gate = asyncio.Event()
    original = engine.pause

    async def slow_pause(mode: str, clear_cache: bool) -> None:
        await gate.wait()
        await original(mode, clear_cache)

    engine.pause = slow_pause  # type: ignore[method-assign]
    op, _ = await updates.start(plan())
    op.cancel()
    gate.set()
    await finished(updates, op)
    engine.pause = original  # type: ignore[method-assign]


async def test_every_update_result_is_counted_and_timed_once(
    updates: WeightUpdates, engine: EngineDouble, exported: Registry
) -> None:
    script = [  # ok, failed (nothing written), partial (written, then failed)
        LoadScript(),
        LoadScript(error=Cause.UPDATE_TIMEOUT, modified=False),
        LoadScript(error=Cause.STREAM_BROKEN, modified=True),
    ]
    for load in script:
        engine.script = load
        op, _ = await updates.start(plan())
        await finished(updates, op)
        await updates.resume(upb.ResumeGenerationRequest(force=True))  # after the partial one
    await cancelled_before_loading(updates, engine)
    assert engine.calls.count("load") == 3  # the cancelled one loaded nothing

    for result in ("ok", "failed", "partial", "cancelled"):
        labels = {"source": "tensors", "result": result}
        assert exported.value("enginectl_weight_updates_total", **labels) == 1, result
        assert exported.value(f"{UPDATE_SECONDS}_count", **labels) == 1, result
        assert exported.value(f"{UPDATE_SECONDS}_bucket", **labels, le="+Inf") == 1, result
    for source in ("disk", "distributed"):  # every series exists from the start, at 0
        assert exported.value("enginectl_weight_updates_total", source=source, result="ok") == 0
        assert exported.value("enginectl_weight_update_bytes_total", source=source) == 0
    assert exported.value("enginectl_weight_staged_bytes") == 0


async def test_pauses_are_timed_by_who_paused_from_pause_to_resume(
    updates: WeightUpdates, engine: EngineDouble, exported: Registry
) -> None:
    def pauses(reason: str) -> float:
        return exported.value(f"{PAUSE_SECONDS}_count", reason=reason)

    assert exported.value("enginectl_generation_paused") == 0
    # A caller's pause lasts until its resume.
    await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    assert exported.value("enginectl_generation_paused") == 1
    await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))  # still the same pause
    assert pauses("caller") == 0
    await updates.resume(upb.ResumeGenerationRequest())
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 0, 0)

    # An update's pause ends when the update resumes generation.
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 1, 0)

    # A partial update holds its pause until a forced resume: one pause, the update's.
    engine.script = LoadScript(error=Cause.LOAD_FAILED, modified=True)
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("update"), exported.value("enginectl_generation_paused")) == (1, 1)
    await updates.resume(upb.ResumeGenerationRequest(force=True))
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 2, 0)

    # A pause made by someone else (vLLM's own API) is not enginectl's: the update neither
    # pauses nor resumes, and nothing is timed.
    engine.script = LoadScript()
    engine.paused = True
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 2, 0)
    assert exported.value(f"{PAUSE_SECONDS}_bucket", reason="update", le="+Inf") == 2


class IdentityEngineDouble:
    """One rank; `fail` makes it refuse to set an identity."""

    def __init__(self) -> None:
        self.held = RankIdentity(0, "", 0)
        self.fail = False

    async def get_worker_identity(self, timeout: float) -> list[RankOutcome[RankIdentity]]:
        return [RankOutcome(0, self.held)]

    async def set_worker_identity(
        self, worker_id: str, generation: int, timeout: float
    ) -> list[RankOutcome[RankIdentity]]:
        if self.fail:
            return [RankOutcome(0, None, RankFailure.RANK_ERROR, "scripted failure")]
        self.held = RankIdentity(0, worker_id, generation)
        return [RankOutcome(0, self.held)]


async def test_identity_syncs_are_counted_by_result(exported: Registry) -> None:
    engine = IdentityEngineDouble()
    sync = IdentitySync(engine, on_synced=exported.metrics.identity_synced)
    await sync.set("worker-a", 5.0)
    await sync.set("worker-a", 5.0)  # every rank holds it already
    engine.fail = True
    with pytest.raises(ControlPlaneError):
        await sync.set("worker-b", 5.0)
    counts = {r: exported.value("enginectl_fpm_identity_syncs_total", result=r) for r in ("ok", "unchanged", "failed")}
    assert counts == {"ok": 1, "unchanged": 1, "failed": 1}
