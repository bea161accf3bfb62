"""FPM samples carry each rank's generation state, checked in the pure cores: the rules that
need states hard to reach on purpose (a partial update) run on RankGeneration
(worker/fpm/generation.py) and on the server's Generation over the in-memory engine double
(tests/support/engine_double.py). The same states on a real engine's stream, and in the
planner, are in tests/e2e/test_fpm_generation_state.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from support.engine_double import EngineDouble, LoadScript
from support.fpm_helpers import RUNNING, state

from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import Cause, PauseReason
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.server.weights.sources.disk import TensorInfo
from enginectl.server.weights.update.operations import OperationStore
from enginectl.server.weights.update.plans import UpdatePlan
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.worker.fpm.generation import RankGeneration

READ_S = 60.0  # deadline of every wait on the stream or the planner


@pytest.fixture
def rank() -> Iterator[tuple[RankGeneration, list[tuple[str, str]]]]:
    """A RankGeneration and every state it published, by name."""
    published: list[tuple[str, str]] = []
    generation = RankGeneration()

    def changed() -> None:
        sample = fpm_pb2.ForwardPassMetrics(
            generation_state=generation.current.state, pause_reason=generation.current.pause_reason
        )
        published.append(state(sample))

    generation.on_change = changed
    yield generation, published


def test_who_pauses_is_remembered_until_the_resume_and_a_foreign_pause_is_external(
    rank: tuple[RankGeneration, list[tuple[str, str]]],
) -> None:
    generation, published = rank
    generation.scheduler_paused(True)  # vLLM's own pause: nobody named a reason
    generation.scheduler_paused(False)
    with generation.pausing(PauseReason.CALLER):
        generation.scheduler_paused(True)
    generation.scheduler_paused(True)  # vLLM's /pause over it: the caller still holds it
    assert published == [("PAUSED", "EXTERNAL"), RUNNING, ("PAUSED", "CALLER")]
    with generation.pausing(PauseReason.UPDATE):  # enginectl names who holds it now
        generation.scheduler_paused(True)
    assert published[-1] == ("PAUSED", "UPDATE")


def test_applying_wins_while_the_load_runs_and_keeps_the_pause_it_runs_under(
    rank: tuple[RankGeneration, list[tuple[str, str]]],
) -> None:
    generation, published = rank
    with generation.pausing(PauseReason.UPDATE):
        generation.scheduler_paused(True)
    with pytest.raises(RuntimeError), generation.applying():
        assert published[-1] == ("APPLYING", "UPDATE")
        raise RuntimeError("the load failed")  # the state ends with the load, however it ends
    assert published == [("PAUSED", "UPDATE"), ("APPLYING", "UPDATE"), ("PAUSED", "UPDATE")]


def test_an_update_that_ends_paused_leaves_the_pause_to_the_caller_and_hold_relabels(
    rank: tuple[RankGeneration, list[tuple[str, str]]],
) -> None:
    generation, published = rank
    generation.hold(PauseReason.PARTIAL_UPDATE)  # not paused: nothing to relabel
    assert published == []
    with generation.pausing(PauseReason.UPDATE):
        generation.scheduler_paused(True)
    generation.hold(PauseReason.PARTIAL_UPDATE)
    generation.update_finished_paused()  # a later update succeeded; the caller held on
    assert published == [("PAUSED", "UPDATE"), ("PAUSED", "PARTIAL_UPDATE"), ("PAUSED", "CALLER")]
    generation.scheduler_paused(False)
    generation.scheduler_paused(True)  # vLLM's /pause
    generation.update_finished_paused()  # an update under someone else's pause leaves it theirs
    assert published[-2:] == [RUNNING, ("PAUSED", "EXTERNAL")]


TENSOR = TensorInfo("w", "float32", (2, 2))


async def test_the_server_names_who_holds_every_pause_it_makes() -> None:
    """Generation over the engine double: the caller's pause is CALLER, an update's is UPDATE,
    and a partial update relabels the pause it leaves PARTIAL_UPDATE (also over a caller's)."""
    engine = EngineDouble()
    ledger = WeightVersionLedger(publish=engine.set_weight_version)
    updates = WeightUpdates(engine, ledger, OperationStore(), allowed_roots=[], expected={TENSOR.name: TENSOR})
    await updates.prepare()
    try:
        plan = UpdatePlan(WeightSource.TENSORS, [TENSOR], [], "", "v1", "", "", "keep", True, 30.0)
        await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
        assert engine.holder is PauseReason.CALLER
        await updates.resume(upb.ResumeGenerationRequest())

        engine.script = LoadScript(release=asyncio.Event())
        op, _ = await updates.start(plan)
        await asyncio.wait_for(engine.loading.wait(), READ_S)
        assert engine.holder is PauseReason.UPDATE
        engine.script.error, engine.script.modified = Cause.STREAM_BROKEN, True
        assert engine.script.release is not None
        engine.script.release.set()
        await asyncio.wait_for(updates.operations.wait(op, None), READ_S)
        assert engine.paused and engine.holder is PauseReason.PARTIAL_UPDATE

        # A caller's pause over a partial update: the partial update still holds it (as
        # GetGenerationState says).
        await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
        assert engine.holder is PauseReason.PARTIAL_UPDATE
        assert (await updates.generation_state()).reason == upb.PAUSE_REASON_PARTIAL_UPDATE
    finally:
        updates.close()
