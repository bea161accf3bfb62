"""vLLM's weight-transfer engine driven as an enginectl update (docs/weights.md, "vLLM's
weight-transfer engines"): a trainer on vLLM's own trainer-side API, with enginectl's `gloo`
engine and enginectl's gRPC four-step client, on the session's weights server (served with
`--weight-transfer-config '{"backend": "gloo"}'`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from google.longrunning import operations_pb2
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

from enginectl.client.errors import AbortedError, EnginectlError, FailedPreconditionError, InvalidArgumentError
from enginectl.client.transfer_client import WeightSyncClient
from enginectl.client.transfer_engine import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    StateDictSource,
    register,
)
from enginectl.common.buckets import cut
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb


@pytest.fixture(scope="module")
def sync(weights_server: ServeProcess) -> Iterator[WeightSyncClient]:
    with WeightSyncClient(weights_server.grpc_target, timeout=60.0, step_timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def trainer(stubs: Stubs, checkpoints: Checkpoints, sync: WeightSyncClient) -> Iterator[Any]:
    register()
    workers = stubs.updates.GetServerInfo(upb.GetServerInfoRequest(), timeout=10).num_workers
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0, timeout_s=30.0),
        client=sync,
        source=StateDictSource(checkpoints.state_dict("B")),
    )
    assert isinstance(engine, GlooTrainerWeightTransferEngine)
    yield engine
    engine.shutdown()
    sync.shutdown_weight_transfer_engine()


def broadcast_round(trainer: Any, sync: WeightSyncClient) -> None:
    """A round's start and its one batch (received beside the broadcast), not finished."""
    sync.start_weight_update()
    send_batch(trainer, sync, list(trainer.source))


def send_batch(trainer: Any, sync: WeightSyncClient, pairs: list[tuple[str, Any]]) -> None:
    """One `update_weights` batch of `pairs`, received beside its broadcast (vLLM's NCCL
    engine's field names)."""
    tensors = [t for _, t in pairs]
    info = {
        "names": [n for n, _ in pairs],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "bucket_bytes": trainer.bucket_bytes,
    }
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            sync.update_weights(info)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    trainer.group.broadcast(tensors, cut([t.numel() * t.element_size() for t in tensors], trainer.bucket_bytes))
    thread.join(60)
    assert not thread.is_alive() and not errors, errors


def test_a_vllm_api_trainer_updates_as_an_enginectl_operation(
    weights_server: ServeProcess,
    stubs: Stubs,
    trainer: Any,
    sync: WeightSyncClient,
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    trainer.send_weights(weight_version="T-1")
    version = stubs.version()
    assert (version.declared, version.version, version.source) == (True, "T-1", wv.WEIGHT_SOURCE_TRANSFER_ENGINE)
    assert greedy_tokens(weights_server) == tokens_b  # the prefix cache was reset
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH
    result = sync.last_result
    assert result is not None and result.weight_version.version == "T-1"
    state = stubs.state()
    assert not state.paused


def test_a_finish_with_a_stale_etag_records_nothing_and_the_round_stays_open(
    stubs: Stubs, trainer: Any, sync: WeightSyncClient, tokens_a: list[int]
) -> None:
    before = stubs.version()
    broadcast_round(trainer, sync)
    with pytest.raises(AbortedError) as refused:
        sync.finish_weight_update("T-stale", etag="not-the-etag")
    assert refused.value.reason == "ETAG_MISMATCH"
    assert stubs.version().etag == before.etag
    sync.finish_weight_update("T-2", etag=before.etag)  # the round was still open
    assert stubs.version().version == "T-2"


def test_steps_out_of_order_are_refused_with_state_unchanged(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, sync: WeightSyncClient, tokens_a: list[int]
) -> None:
    before = stubs.version()
    with pytest.raises(FailedPreconditionError) as early:
        sync.update_weights(trainer.update_info())
    assert early.value.reason == "TRANSFER_NOT_STARTED"
    with pytest.raises(FailedPreconditionError) as finish_first:
        sync.finish_weight_update("T-x")
    assert finish_first.value.reason == "TRANSFER_NOT_STARTED"
    sync.start_weight_update()
    with pytest.raises(EnginectlError) as twice:
        sync.start_weight_update()
    assert twice.value.reason == "UPDATE_IN_PROGRESS"
    stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=sync.operation), timeout=10)
    cancelled = stubs.wait(operations_pb2.Operation(name=sync.operation), timeout=30)
    assert "UPDATE_CANCELLED" in str(cancelled.error)
    assert stubs.version().etag == before.etag
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a


def test_an_init_that_can_not_take_over_leaves_the_trainers_connection(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, sync: WeightSyncClient, tokens_a: list[int]
) -> None:
    """docs/weights.md, "A trainer that restarts": an init whose info does not parse, and an
    init while a round is open, are refused before any worker lets the live trainer's
    connection go (its next batch still arrives); the refusal names the open round, whose
    CancelOperation ends it at once, well inside its step timeout (30 s here)."""
    before = stubs.version()
    elsewhere = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    with pytest.raises(InvalidArgumentError) as bad:
        sync.init_weight_transfer_engine(dict(elsewhere, rank_offset=0))
    assert bad.value.reason == "TRANSFER_INIT_INVALID"
    sync.start_weight_update()
    with pytest.raises(AbortedError) as open_round:
        sync.init_weight_transfer_engine(elsewhere)
    refused = open_round.value
    assert (refused.reason, refused.metadata["operation"]) == ("UPDATE_IN_PROGRESS", sync.operation)
    assert f"CancelOperation(name={sync.operation!r})" in refused.message, refused.message
    send_batch(trainer, sync, list(trainer.source))  # the connection both refusals left in place
    stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=sync.operation), timeout=10)
    cancelled = stubs.wait(operations_pb2.Operation(name=sync.operation), timeout=15)
    assert cancelled.done and "UPDATE_CANCELLED" in str(cancelled.error), cancelled
    assert stubs.version().etag == before.etag
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a


def test_a_trainer_gone_between_start_and_finish_fails_the_round_in_its_step_timeout(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, checkpoints: Checkpoints, tokens_a: list[int]
) -> None:
    """The trainer starts a round, sends one batch and goes away: the round fails with
    TRANSFER_STEP_TIMEOUT in its step timeout. The `gloo` engine had not touched the model
    (it applies at its finish), so nothing is partial: the version is unchanged and generation
    resumed; the next round succeeds."""
    before = stubs.version()
    with WeightSyncClient(weights_server.grpc_target, timeout=60.0, step_timeout=2.0) as quick:
        started = time.monotonic()
        broadcast_round(trainer, quick)
        done = stubs.wait(operations_pb2.Operation(name=quick.operation), timeout=30)
        assert time.monotonic() - started < 2.0 + 20.0
    assert done.error.message and "TRANSFER_STEP_TIMEOUT" in str(done.error)
    after = stubs.version()
    assert (after.version, after.etag) == (before.version, before.etag)
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a


def test_a_round_with_no_batch_declares_and_leaves_the_weights(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, sync: WeightSyncClient, tokens_a: list[int]
) -> None:
    """start then finish: the `gloo` engine has nothing to apply (an empty reload would not be
    a no-op), the version is recorded over the same weights."""
    sync.start_weight_update()
    sync.finish_weight_update("T-empty")
    assert stubs.version().version == "T-empty"
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH


# --- a round that stages (docs/weights.md, "Two-phase updates") -------------------------------


def test_a_staged_round_changes_nothing_until_its_commit_while_generation_goes_on(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int], tokens_b: list[int]
) -> None:
    """stage_only through the `gloo` engine: its two batches land in the workers' staging
    buffers (vLLM's weight-update target), not the model; between them concurrent clients
    generate A's tokens, unpaused; the finish leaves a staged set under its version, and
    CommitStagedWeights applies it as every commit, recorded as a transfer engine's."""
    before = stubs.version()
    pairs = list(trainer.source)
    with WeightSyncClient(weights_server.grpc_target, timeout=120.0, step_timeout=60.0, stage_only=True) as stage:
        stage.start_weight_update()
        send_batch(trainer, stage, pairs[: len(pairs) // 2])
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(lambda _: greedy_tokens(weights_server), range(6))) == [tokens_a] * 6
        state = stubs.state()
        assert not state.paused and state.update_operation == ""
        with pytest.raises(AbortedError) as busy:  # the stage holds the one update slot
            sync_other = WeightSyncClient(weights_server.grpc_target)
            try:
                sync_other.start_weight_update()
            finally:
                sync_other.close()
        assert busy.value.reason == "UPDATE_IN_PROGRESS"
        send_batch(trainer, stage, pairs[len(pairs) // 2 :])
        stage.finish_weight_update("S-1")
        assert stage.last_result is not None
        staged = stage.last_result.staged
    assert staged is not None and (staged.weight_version, staged.tensors) == ("S-1", len(pairs))
    assert staged.bytes == sum(t.numel() * t.element_size() for _, t in pairs)
    after = stubs.version()
    assert (after.version, after.etag) == (before.version, before.etag)
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.state().staged.name == staged.name

    commit = stubs.wait(stubs.updates.CommitStagedWeights(upb.CommitStagedWeightsRequest(name=staged.name)))
    assert commit.WhichOneof("result") == "response", commit.error
    version = stubs.version()
    assert (version.version, version.source) == ("S-1", wv.WEIGHT_SOURCE_TRANSFER_ENGINE)
    assert greedy_tokens(weights_server) == tokens_b
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH


def test_a_staged_round_past_the_staging_limit_is_refused_before_its_batch_and_stages_nothing(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int]
) -> None:
    """The server stages at most --max-staged-bytes (here: the model's size). A batch that
    would pass it is refused before any worker receives it (no broadcast is needed to see
    it), the stage fails with the limit's reason, and nothing is left staged."""
    before = stubs.version()
    pairs = list(trainer.source)
    with WeightSyncClient(weights_server.grpc_target, timeout=120.0, step_timeout=60.0, stage_only=True) as stage:
        stage.start_weight_update()
        send_batch(trainer, stage, pairs)  # the whole model: at the limit, accepted
        doubled = {"names": ["extra"], "dtype_names": ["float32"], "shapes": [[1024]]}
        with pytest.raises(EnginectlError) as over:
            stage.update_weights(doubled)
        assert over.value.reason == "STAGING_LIMIT_EXCEEDED"
        done = stubs.wait(operations_pb2.Operation(name=stage.operation), timeout=30)
    assert "STAGING_LIMIT_EXCEEDED" in str(done.error)
    assert not stubs.state().HasField("staged")
    assert stubs.version().etag == before.etag
    assert greedy_tokens(weights_server) == tokens_a


def test_discarding_a_staged_round_mid_way_ends_it_and_keeps_nothing(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int]
) -> None:
    """The set a staged round fills is visible (not complete) in GetGenerationState; a
    discard of it cancels the round (UPDATE_CANCELLED), frees it, and the next round runs."""
    before = stubs.version()
    pairs = list(trainer.source)
    with WeightSyncClient(weights_server.grpc_target, timeout=120.0, step_timeout=60.0, stage_only=True) as stage:
        stage.start_weight_update()
        send_batch(trainer, stage, pairs[:1])
        filling = stubs.state().staged
        assert filling.name.startswith("staged/") and not filling.HasField("stage_time")
        stubs.updates.DiscardStagedWeights(upb.DiscardStagedWeightsRequest(name=filling.name), timeout=30)
        done = stubs.wait(operations_pb2.Operation(name=stage.operation), timeout=30)
        assert "UPDATE_CANCELLED" in str(done.error)
        with pytest.raises(FailedPreconditionError) as ended:
            stage.update_weights(trainer.update_info())
        assert ended.value.reason == "TRANSFER_NOT_STARTED"
    assert not stubs.state().HasField("staged")
    assert stubs.version().etag == before.etag
    assert greedy_tokens(weights_server) == tokens_a
    trainer.send_weights(weight_version="after-discard")  # the group and the engine serve on
    assert stubs.version().version == "after-discard"
