"""Transfer-engine rounds (server/weights/transfer.py) as pure code, against an in-memory engine.

The partial rule of a round depends on when the engine writes into the model: vLLM's `nccl`
loads each batch as it arrives, enginectl's `gloo` only at its finish. The CPU build runs only
`gloo` (tests/e2e/weight_updates/test_transfer_*.py show it end to end); an engine that writes
per batch and then fails is what tests/support/engine_double.py stands in for here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from google.protobuf import struct_pb2
from support.engine_double import EngineDouble

from enginectl.common.vocabulary import Reason
from enginectl.contract.engine import TransferStep
from enginectl.server.errors import ControlPlaneError
from enginectl.server.weights.sources.disk import TensorInfo
from enginectl.server.weights.transfer import WeightTransfer, plain
from enginectl.server.weights.update.operations import OperationStore, UpdateOperation
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

TENSOR = TensorInfo("w", "float32", (2, 2))
ROUND_ID = "7f1c2b4e-3d5a-4e6f-8a9b-0c1d2e3f4a5b"
BATCH = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}


@pytest.fixture
async def engine() -> EngineDouble:
    return EngineDouble()


@pytest.fixture
def quarantines() -> list[bool]:
    return []


@pytest.fixture
async def ledger(engine: EngineDouble) -> WeightVersionLedger:
    return WeightVersionLedger(publish=engine.set_weight_version)


@pytest.fixture
async def updates(
    engine: EngineDouble, ledger: WeightVersionLedger, quarantines: list[bool]
) -> AsyncIterator[WeightUpdates]:
    async def on_partial(on: bool) -> None:
        quarantines.append(on)

    updates = WeightUpdates(
        engine, ledger, OperationStore(), allowed_roots=[], expected={TENSOR.name: TENSOR}, on_partial=on_partial
    )
    await updates.prepare()
    yield updates
    updates.close()


async def initialized(engine: EngineDouble, updates: WeightUpdates, backend: str) -> WeightTransfer:
    transfer = WeightTransfer(engine, updates, backend)
    info = struct_pb2.Struct()
    info.update({"master_address": "127.0.0.1", "master_port": 29500})
    await transfer.init(pb2.InitWeightTransferEngineRequest(init_info=info))
    return transfer


def batch() -> pb2.UpdateWeightsRequest:
    value = struct_pb2.Value()
    value.struct_value.update(BATCH)
    return pb2.UpdateWeightsRequest(update_info=value)


async def ended(updates: WeightUpdates, op: UpdateOperation) -> UpdateOperation:
    await asyncio.wait_for(updates.operations.wait(op, None), 10.0)
    return op


async def test_a_batch_that_fails_after_a_per_batch_engine_wrote_quarantines(
    engine: EngineDouble, updates: WeightUpdates, ledger: WeightVersionLedger, quarantines: list[bool]
) -> None:
    transfer = await initialized(engine, updates, "nccl")
    engine.transfer_failures[TransferStep.UPDATE] = "RuntimeError: NCCL error: remote process exited"
    op = await transfer.start(pb2.StartWeightUpdateRequest(weight_version="v1"))
    with pytest.raises(ControlPlaneError) as failed:
        await transfer.update(batch())
    assert failed.value.reason == Reason.PARTIAL_UPDATE
    await ended(updates, op)
    state = updates.generation
    assert quarantines == [True] and state.partial
    version = ledger.state  # undeclared, with the failure
    assert not version.declared and version.last_failure is not None
    assert version.last_failure.cause == Reason.TRANSFER_FAILED
    assert "transfer:abort" in engine.calls  # the round was ended on the workers
    # A later good round brings it back.
    engine.transfer_failures.clear()
    op = await transfer.start(pb2.StartWeightUpdateRequest())
    await transfer.update(batch())
    await transfer.finish(pb2.FinishWeightUpdateRequest(weight_version="v2"))
    assert op.done and op.failure is None
    assert ledger.state.version == "v2" and quarantines == [True, False]


async def test_a_failed_gloo_batch_changes_nothing(
    engine: EngineDouble, updates: WeightUpdates, ledger: WeightVersionLedger, quarantines: list[bool]
) -> None:
    """`gloo` writes only at its finish: a failed batch is not partial."""
    transfer = await initialized(engine, updates, "gloo")
    engine.transfer_failures[TransferStep.UPDATE] = "RuntimeError: Connection closed by peer"
    before = ledger.state
    op = await transfer.start(pb2.StartWeightUpdateRequest(weight_version="v1"))
    with pytest.raises(ControlPlaneError) as failed:
        await transfer.update(batch())
    assert failed.value.reason == Reason.TRANSFER_FAILED
    await ended(updates, op)
    assert quarantines == [] and not updates.generation.partial
    assert ledger.state.etag == before.etag


async def test_a_trainer_silent_after_a_batch_fails_the_round_at_its_step_timeout(
    engine: EngineDouble, updates: WeightUpdates, quarantines: list[bool]
) -> None:
    transfer = await initialized(engine, updates, "nccl")
    request = pb2.StartWeightUpdateRequest()
    request.step_timeout.FromMilliseconds(200)
    op = await transfer.start(request)
    await transfer.update(batch())
    await ended(updates, op)
    assert op.failure is not None and op.failure.reason == Reason.PARTIAL_UPDATE
    assert op.failure.metadata["cause"] == Reason.TRANSFER_STEP_TIMEOUT
    assert quarantines == [True]
    with pytest.raises(ControlPlaneError) as late:  # the round is gone
        await transfer.update(batch())
    assert late.value.reason == Reason.TRANSFER_NOT_STARTED


async def test_refusals_change_nothing(engine: EngineDouble, updates: WeightUpdates) -> None:
    unconfigured = WeightTransfer(engine, updates, None)
    with pytest.raises(ControlPlaneError) as none:
        await unconfigured.start(pb2.StartWeightUpdateRequest())
    assert none.value.reason == Reason.TRANSFER_NOT_CONFIGURED
    transfer = WeightTransfer(engine, updates, "gloo")
    with pytest.raises(ControlPlaneError) as early:
        await transfer.start(pb2.StartWeightUpdateRequest())
    assert early.value.reason == Reason.TRANSFER_NOT_INITIALIZED
    per_batch = WeightTransfer(engine, updates, "nccl")  # loads each batch as it arrives: no staging target
    with pytest.raises(ControlPlaneError) as staged:
        await per_batch.start(pb2.StartWeightUpdateRequest(stage_only=True))
    assert staged.value.reason == Reason.STAGE_UNSUPPORTED and "'nccl'" in staged.value.message
    assert not any(call.startswith("transfer:") for call in engine.calls)


async def test_a_start_retried_with_its_request_id_answers_the_first_round(
    engine: EngineDouble, updates: WeightUpdates, ledger: WeightVersionLedger
) -> None:
    """A trainer that lost the answer to its start and sends it again gets the same round (one
    engine start); the same request id with other fields is refused, the round unharmed."""
    transfer = await initialized(engine, updates, "gloo")
    first = await transfer.start(pb2.StartWeightUpdateRequest(weight_version="v1", request_id=ROUND_ID))
    again = await transfer.start(pb2.StartWeightUpdateRequest(weight_version="v1", request_id=ROUND_ID))
    assert again is first
    with pytest.raises(ControlPlaneError) as reused:
        await transfer.start(pb2.StartWeightUpdateRequest(weight_version="v2", request_id=ROUND_ID))
    assert reused.value.reason == Reason.REQUEST_ID_REUSED
    await transfer.update(batch())
    await transfer.finish(pb2.FinishWeightUpdateRequest())
    await ended(updates, first)
    assert first.failure is None and ledger.state.version == "v1"
    assert engine.calls.count("transfer:start") == 1


def test_struct_numbers_come_back_as_ints() -> None:
    assert plain({"port": 29500.0, "shapes": [[2.0, 3.0]], "t": 1.5}) == {"port": 29500, "shapes": [[2, 3]], "t": 1.5}


async def test_an_init_while_initialized_takes_over_unless_refused_or_a_round_is_open(
    engine: EngineDouble, updates: WeightUpdates
) -> None:
    """docs/weights.md, "A trainer that restarts": an init over a connection takes it over
    (counted); one the workers' parse refuses changes nothing (the connection stays, nothing
    shut down); with a round open the init names the round; concurrent inits run one after the
    other, each taking over from the one before."""
    taken: list[str] = []
    transfer = WeightTransfer(engine, updates, "gloo", on_takeover=taken.append)
    info = struct_pb2.Struct()
    info.update({"master_address": "127.0.0.1", "master_port": 29500})
    request = pb2.InitWeightTransferEngineRequest(init_info=info)
    await transfer.init(request)
    assert taken == [] and transfer.initialized
    await transfer.init(request)
    assert taken == ["transfer_engine"] and transfer.initialized

    engine.transfer_refusals[TransferStep.INIT] = "ValueError: rank_offset must be >= 1"
    engine.calls.clear()
    with pytest.raises(ControlPlaneError) as refused:
        await transfer.init(request)
    assert refused.value.reason == Reason.TRANSFER_INIT_INVALID
    assert taken == ["transfer_engine"] and transfer.initialized and engine.calls == ["transfer:init"]
    engine.transfer_refusals.clear()

    op = await transfer.start(pb2.StartWeightUpdateRequest())
    with pytest.raises(ControlPlaneError) as busy:
        await transfer.init(request)
    assert (busy.value.reason, busy.value.metadata["operation"]) == (Reason.UPDATE_IN_PROGRESS, op.name)
    assert f"CancelOperation(name={op.name!r})" in busy.value.message
    op.cancel()
    await ended(updates, op)

    await asyncio.gather(transfer.init(request), transfer.init(request))
    assert taken == ["transfer_engine"] * 3
