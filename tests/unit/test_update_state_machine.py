"""The update state machine (server/weights/) as pure code, against an in-memory engine.

No vLLM, no gRPC: WeightUpdates, its ledger and operations run on this test's loop against
tests/support/engine_double.py. The same rules are checked end to end on a real engine in
tests/e2e/: weight_updates/test_weight_update.py, test_update_edges.py and test_faults.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from support.engine_double import EngineDouble, LoadScript

from enginectl.common.vocabulary import Reason, WeightSource
from enginectl.contract.engine import Cause
from enginectl.server.errors import ControlPlaneError
from enginectl.server.weights.sources.disk import TensorInfo
from enginectl.server.weights.update.operations import OperationStore, UpdateOperation
from enginectl.server.weights.update.plans import UpdatePlan
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

WAIT_S = 10.0
TENSOR = TensorInfo("w", "float32", (2, 2))


@pytest.fixture
async def engine() -> EngineDouble:
    return EngineDouble()


@pytest.fixture
async def ledger(engine: EngineDouble) -> WeightVersionLedger:
    return WeightVersionLedger(publish=engine.set_weight_version)


@pytest.fixture
def quarantines() -> list[bool]:
    """What the updates told the server's health of quarantine (on_partial), in order."""
    return []


@pytest.fixture
async def updates(
    engine: EngineDouble, ledger: WeightVersionLedger, quarantines: list[bool]
) -> AsyncIterator[WeightUpdates]:
    async def on_partial(on: bool) -> None:
        quarantines.append(on)

    store = OperationStore()
    updates = WeightUpdates(
        engine, ledger, store, allowed_roots=[], expected={TENSOR.name: TENSOR}, on_partial=on_partial
    )
    await updates.prepare()
    yield updates
    updates.close()


def plan(version: str | None = "v1", *, mode: str = "keep", request_id: str = "") -> UpdatePlan:
    return UpdatePlan(WeightSource.TENSORS, [TENSOR], [], "", version, "", request_id, mode, True, 30.0)


async def finished(updates: WeightUpdates, op: UpdateOperation) -> UpdateOperation:
    await asyncio.wait_for(updates.operations.wait(op, None), WAIT_S)
    assert op.done
    return op


def error_reason(op: UpdateOperation) -> str:
    assert op.failure is not None, "the operation succeeded"
    return op.failure.reason


async def test_an_update_pauses_with_keep_loads_records_and_resumes(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
) -> None:
    engine.running = 2
    op, started = await updates.start(plan("v1"))
    assert started
    await finished(updates, op)
    assert op.failure is None
    assert engine.calls == ["pause:keep", "load", "check_loaded", "finish_update:resume=True"]
    assert (ledger.state.version, ledger.state.source) == ("v1", WeightSource.TENSORS)
    assert engine.version == "v1" and not engine.paused
    response = pb2.UpdateWeightsResponse()
    assert op.proto().response.Unpack(response)
    assert (response.num_paused_requests, response.generation_resumed) == (2, True)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_the_requested_pause_mode_reaches_the_engine(
    updates: WeightUpdates, engine: EngineDouble, mode: str
) -> None:
    await finished(updates, (await updates.start(plan(mode=mode)))[0])
    assert engine.calls[0] == f"pause:{mode}"


async def test_an_engine_already_paused_is_not_paused_again_nor_resumed(
    updates: WeightUpdates,
    engine: EngineDouble,
) -> None:
    engine.paused = True  # paused by someone else (vLLM's own API)
    await finished(updates, (await updates.start(plan()))[0])
    assert engine.calls == ["load", "check_loaded", "finish_update:resume=False"]
    assert engine.paused


async def test_one_update_at_a_time_and_a_retry_returns_the_first(updates: WeightUpdates, engine: EngineDouble) -> None:
    engine.script = LoadScript(release=asyncio.Event())
    first, _ = await updates.start(plan("v1", request_id="r-1"))
    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
    with pytest.raises(ControlPlaneError) as err:
        await updates.start(plan("v2"))
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.ABORTED, Reason.UPDATE_IN_PROGRESS)
    assert err.value.metadata["operation"] == first.name
    again, started = await updates.start(plan("v1", request_id="r-1"))
    assert (again, started) == (first, False)
    with pytest.raises(ControlPlaneError) as err:
        await updates.start(plan("other", request_id="r-1"))
    assert err.value.reason == Reason.REQUEST_ID_REUSED
    assert engine.script.release is not None
    engine.script.release.set()
    await finished(updates, first)
    await finished(updates, (await updates.start(plan("v2")))[0])  # the next one may run


async def test_a_keep_pause_during_an_update_holds_generation_after_it(
    updates: WeightUpdates,
    engine: EngineDouble,
) -> None:
    engine.script = LoadScript(release=asyncio.Event())
    op, _ = await updates.start(plan())
    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
    state = await updates.generation_state()
    assert (state.paused, state.reason, state.update_operation) == (True, pb2.PAUSE_REASON_UPDATE, op.name)
    with pytest.raises(ControlPlaneError) as err:  # ABORT and WAIT need the engine, which is loading
        await updates.pause(pb2.PauseGenerationRequest(mode=pb2.PAUSE_MODE_ABORT))
    assert err.value.reason == Reason.UPDATE_IN_PROGRESS
    paused = await updates.pause(pb2.PauseGenerationRequest(mode=pb2.PAUSE_MODE_KEEP))
    assert paused.was_paused
    assert engine.script.release is not None
    engine.script.release.set()
    await finished(updates, op)
    assert engine.calls[-1] == "finish_update:resume=False"
    state = await updates.generation_state()
    assert (state.paused, state.reason) == (True, pb2.PAUSE_REASON_CALLER)


async def test_a_resume_during_an_update_lets_the_update_resume(updates: WeightUpdates, engine: EngineDouble) -> None:
    await updates.pause(pb2.PauseGenerationRequest(mode=pb2.PAUSE_MODE_KEEP))
    await updates.resume(pb2.ResumeGenerationRequest())
    engine.calls.clear()
    engine.script = LoadScript(release=asyncio.Event())
    op, _ = await updates.start(plan())
    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
    with pytest.raises(ControlPlaneError) as err:  # nothing to resume: the update holds the pause
        await updates.resume(pb2.ResumeGenerationRequest())
    assert err.value.reason == Reason.UPDATE_IN_PROGRESS
    assert engine.script.release is not None
    engine.script.release.set()
    await finished(updates, op)
    assert not engine.paused


async def test_a_caller_resume_during_an_update_that_found_the_caller_paused_is_kept(
    updates: WeightUpdates, engine: EngineDouble
) -> None:
    """Paused by a caller before the update; the caller resumes while it loads: generation
    runs again once the update ends (it must not stay paused with nobody holding it)."""
    await updates.pause(pb2.PauseGenerationRequest(mode=pb2.PAUSE_MODE_KEEP))
    engine.calls.clear()
    engine.script = LoadScript(release=asyncio.Event())
    op, _ = await updates.start(plan())
    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
    resumed = await updates.resume(pb2.ResumeGenerationRequest())
    assert resumed.was_paused
    assert engine.script.release is not None
    engine.script.release.set()
    await finished(updates, op)
    assert op.failure is None
    assert engine.calls == ["load", "check_loaded", "finish_update:resume=True"]
    state = await updates.generation_state()
    assert not state.paused and not engine.paused


async def test_a_wait_pause_whose_call_ends_while_draining_is_undone(
    updates: WeightUpdates, engine: EngineDouble
) -> None:
    """The caller's deadline passes (the handler is cancelled) while WAIT drains: generation
    must not stay paused with nobody holding the pause."""
    engine.running, engine.drained = 1, asyncio.Event()
    call = asyncio.create_task(updates.pause(pb2.PauseGenerationRequest(mode=pb2.PAUSE_MODE_WAIT)))
    await asyncio.wait_for(engine.draining.wait(), WAIT_S)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine.calls[-1] == "resume" and not engine.paused
    state = await updates.generation_state()
    assert not state.paused


async def test_a_failure_before_writing_resumes_and_keeps_the_version(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
) -> None:
    before = await ledger.declare("v0")
    engine.script = LoadScript(error=Cause.UPDATE_TIMEOUT, modified=False)
    op = await finished(updates, (await updates.start(plan("v1")))[0])
    assert error_reason(op) == Cause.UPDATE_TIMEOUT.value
    assert op.failure is not None and op.failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ledger.state == before
    assert not engine.paused and engine.calls[-1] == "resume"


async def test_a_partial_update_leaves_undeclared_paused_until_forced_or_reloaded(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
) -> None:
    await ledger.declare("v0")
    engine.script = LoadScript(error=Cause.STREAM_BROKEN, modified=True)
    op = await finished(updates, (await updates.start(plan("v1")))[0])
    assert error_reason(op) == Reason.PARTIAL_UPDATE
    assert op.failure is not None and op.failure.metadata["cause"] == Cause.STREAM_BROKEN.value
    assert not ledger.state.declared and ledger.state.last_failure is not None
    assert engine.paused
    state = await updates.generation_state()
    assert state.reason == pb2.PAUSE_REASON_PARTIAL_UPDATE
    with pytest.raises(ControlPlaneError) as err:  # no version over mixed weights
        await ledger.declare("v1")
    assert err.value.reason == Reason.PARTIAL_UPDATE
    with pytest.raises(ControlPlaneError) as err:
        await updates.resume(pb2.ResumeGenerationRequest())
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.PARTIAL_UPDATE)
    assert engine.paused
    # A successful update clears the failure and resumes (it is the one holding the pause now).
    engine.script = LoadScript()
    await finished(updates, (await updates.start(plan("v2")))[0])
    assert (ledger.state.version, ledger.state.last_failure) == ("v2", None)
    assert not engine.paused


async def test_a_forced_resume_after_a_partial_update(
    updates: WeightUpdates, engine: EngineDouble, quarantines: list[bool]
) -> None:
    heard = quarantines
    engine.script = LoadScript(error=Cause.LOAD_FAILED, modified=True)
    await finished(updates, (await updates.start(plan()))[0])
    assert heard == [True]
    resumed = await updates.resume(pb2.ResumeGenerationRequest(force=True))
    assert resumed.was_paused and not engine.paused
    assert not (await updates.generation_state()).paused
    # Generation runs, but the quarantine holds: the weights may still be mixed.
    assert updates.generation.quarantined and heard == [True]
    engine.script = LoadScript()
    await finished(updates, (await updates.start(plan("v2")))[0])
    assert not updates.generation.quarantined and heard == [True, False]


@pytest.mark.parametrize(
    ("script", "cause", "key"),
    [
        (LoadScript(not_finite="model.layers.0.mlp.down_proj"), Cause.WEIGHTS_NOT_FINITE, "tensor"),
        (LoadScript(mismatch_layer="model.layers.0.mlp.down_proj"), Cause.WEIGHTS_MISMATCH, "layer"),
    ],
)
async def test_a_load_whose_model_computes_wrong_fails_as_written_naming_the_layer(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
    quarantines: list[bool],
    script: LoadScript,
    cause: Cause,
    key: str,
) -> None:
    """The check after the load (worker/weights/checks.py) names a layer that computes NaN, or
    not with what was written into it: the weights are not served (undeclared, held paused,
    quarantined), and the layer is in the error."""
    await ledger.declare("v0")
    engine.script = script
    op = await finished(updates, (await updates.start(plan("nan")))[0])
    assert error_reason(op) == Reason.PARTIAL_UPDATE
    assert op.failure is not None
    assert (op.failure.metadata["cause"], op.failure.metadata[key]) == (cause.value, "model.layers.0.mlp.down_proj")
    assert "model.layers.0.mlp.down_proj" in op.failure.message
    assert not ledger.state.declared and engine.paused and quarantines == [True]
    assert "finish_update:resume=True" not in engine.calls  # never resumed over them


async def test_an_update_after_a_partial_one_clears_the_kv_cache_and_resets_the_prefix_cache(
    updates: WeightUpdates, engine: EngineDouble
) -> None:
    engine.script = LoadScript(error=Cause.STREAM_BROKEN, modified=True)
    await finished(updates, (await updates.start(plan("broken")))[0])
    await updates.resume(pb2.ResumeGenerationRequest(force=True))  # generation over mixed weights
    engine.calls.clear()
    engine.script = LoadScript()
    keep_cache = UpdatePlan(WeightSource.TENSORS, [TENSOR], [], "", "v2", "", "", "keep", False, 30.0)
    op = await finished(updates, (await updates.start(keep_cache))[0])
    assert op.failure is None
    assert "check_loaded clear_kv" in engine.calls
    assert engine.finished_with is not None and engine.finished_with.reset_cache  # whatever was asked
    assert op.response is not None and op.response.prefix_cache_reset  # and says so
    # The next update, from a whole model, neither clears nor overrides the request.
    engine.calls.clear()
    await finished(updates, (await updates.start(keep_cache))[0])
    assert "check_loaded" in engine.calls and not engine.finished_with.reset_cache


async def test_a_declaration_accepted_during_an_update_applies_after_it(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
) -> None:
    engine.script = LoadScript(release=asyncio.Event())
    op, _ = await updates.start(plan("from-update"))
    declaration = asyncio.ensure_future(ledger.declare("declared-after"))
    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
    assert not declaration.done()  # waits for the update's record
    assert engine.script.release is not None
    engine.script.release.set()
    await finished(updates, op)
    state = await asyncio.wait_for(declaration, WAIT_S)
    assert state.version == "declared-after"
    assert engine.version == "declared-after"
    response = pb2.UpdateWeightsResponse()
    assert op.proto().response.Unpack(response)
    assert response.weight_version.version == "from-update"
    assert response.weight_version.revision == state.revision - 1


async def test_a_cancel_before_loading_ends_cancelled_without_writing(
    updates: WeightUpdates,
    engine: EngineDouble,
    ledger: WeightVersionLedger,
) -> None:
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
    assert error_reason(op) == Cause.UPDATE_CANCELLED.value
    assert "load" not in engine.calls and not ledger.state.declared and not engine.paused
    details = [d for d in op.proto().error.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert details
