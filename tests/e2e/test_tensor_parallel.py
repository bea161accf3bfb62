"""Tensor parallelism: two workers per rank (`--tensor-parallel-size 2`, vLLM's `mp` executor), and
every update path reaches both (docs/architecture.md, "Update channels").

With TP every worker of a rank loads every tensor (its shard of it). A data channel shared by the
rank's workers would deal the tensor stream's chunks round-robin between them (a ZMQ PUSH never
copies to each peer), so each would get about half and the update would end partial after its
timeout. Here every path is run on one real TP=2 engine, started as a user would, with no
binding of the workers' threads: vLLM's own would refuse two workers on one NUMA node, so
enginectl splits the CPUs between them (server/cpu_binding.py). Each path must give every worker
the shard a disk load gives it (the workers' full digests are compared with the disk load's),
change the greedy tokens, and restore the original ones when A is loaded back. A cancelled stream
stops both workers, and a stream broken mid-way is partial on both, never on one.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.fault_helpers import Stubs, assert_partial, failure, metadata, stalled_stream
from support.serving import ServeProcess
from support.weights import Checkpoints, greedy_tokens, start_weights_server, stop_server
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

from e2e.own_servers import own_checkpoints, trainer_client
from enginectl.client import TrainerClient
from enginectl.client.transfer_client import WeightSyncClient
from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register
from enginectl.weights.v1 import weight_update_service_pb2 as upb

pytestmark = pytest.mark.slow

TP = 2

checkpoints = own_checkpoints()
client = trainer_client()


@pytest.fixture(scope="module")
def weights_server(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[ServeProcess]:
    env = {k: v for k, v in serve_env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    srv = start_weights_server(
        env,
        checkpoints,
        "--tensor-parallel-size",
        str(TP),
        "--distributed-executor-backend",
        "mp",
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def stubs(weights_server: ServeProcess) -> Iterator[Stubs]:
    s = Stubs(weights_server)
    yield s
    s.close()


@pytest.fixture(scope="module")
def states(checkpoints: Checkpoints) -> dict[str, dict[str, Any]]:
    return {which: checkpoints.state_dict(which) for which in ("A", "B")}


@pytest.fixture(scope="module")
def reference(
    weights_server: ServeProcess, client: TrainerClient, checkpoints: Checkpoints
) -> dict[str, tuple[list[int], tuple[str, ...]]]:
    """Per checkpoint: the greedy tokens and every worker's full digest after a disk load (each
    worker reads the file itself: no channel is involved)."""
    out = {}
    for which, path in (("B", checkpoints.b), ("A", checkpoints.a)):
        client.update_weights_from_disk(str(path), f"disk-{which}", timeout=120)
        out[which] = (greedy_tokens(weights_server), worker_digests(client))
    assert out["A"][0] != out["B"][0], "checkpoint B must generate differently from A"
    return out


@pytest.fixture(scope="module")
def transfer(weights_server: ServeProcess, states: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """A trainer on vLLM's own trainer-side API with enginectl's gloo engine, its group joined by
    both workers (world size 1 + 2)."""
    register()
    with WeightSyncClient(weights_server.grpc_target, timeout=60.0, step_timeout=30.0) as sync:
        engine = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + TP, rank=0, timeout_s=30.0),
            client=sync,
            source=StateDictSource(states["B"]),
        )
        yield engine
        engine.shutdown()
        sync.shutdown_weight_transfer_engine()


def worker_digests(client: TrainerClient) -> tuple[str, ...]:
    """Every worker's full digest now, checking VerifyWeights names each worker and matches."""
    verification = client.verify_weights(full=True)
    assert verification.verdict == "MATCH", verification
    (rank,) = verification.ranks
    assert [(w.worker_rank, w.verdict) for w in rank.workers] == [(w, "MATCH") for w in range(TP)], rank
    digests = tuple(w.current_digest for w in rank.workers)
    assert len(set(digests)) == TP, "each worker holds its own shard"
    return digests


def _tensors(client: TrainerClient, state: dict[str, Any], version: str, _: Any) -> Any:
    return client.update_weights_from_tensors(state, version, timeout=60)


def _ipc(client: TrainerClient, state: dict[str, Any], version: str, _: Any) -> Any:
    return client.update_weights_from_ipc(state, version, timeout=60)


def _broadcast(client: TrainerClient, state: dict[str, Any], version: str, _: Any) -> Any:
    client.init_weights_update_group("tp-group", timeout=60)
    try:
        return client.broadcast_weights(state, version, group_name="tp-group", timeout=60)
    finally:
        client.destroy_weights_update_group("tp-group", allow_missing=True)


def _staged_stream(client: TrainerClient, state: dict[str, Any], version: str, _: Any) -> Any:
    staged = client.stage_weights_from_tensors(state, version, timeout=60)
    return client.commit_staged_weights(staged.name)


def _staged_broadcast(client: TrainerClient, state: dict[str, Any], version: str, _: Any) -> Any:
    client.init_weights_update_group("tp-stage", timeout=60)
    try:
        staged = client.stage_broadcast_weights(state, version, group_name="tp-stage", timeout=60)
    finally:
        client.destroy_weights_update_group("tp-stage", allow_missing=True)
    return client.commit_staged_weights(staged.name)


def _transfer_round(client: TrainerClient, state: dict[str, Any], version: str, trainer: Any) -> Any:
    trainer.source = StateDictSource(state)
    trainer.send_weights(weight_version=version)
    return trainer.client.last_result


PATHS: dict[str, Callable[[TrainerClient, dict[str, Any], str, Any], Any]] = {
    "tensor-stream": _tensors,
    "ipc": _ipc,
    "broadcast": _broadcast,
    "staged-stream": _staged_stream,
    "staged-broadcast": _staged_broadcast,
    "transfer-round": _transfer_round,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_update_path_gives_each_worker_its_whole_shard(
    path: str,
    weights_server: ServeProcess,
    client: TrainerClient,
    states: dict[str, dict[str, Any]],
    reference: dict[str, tuple[list[int], tuple[str, ...]]],
    request: pytest.FixtureRequest,
) -> None:
    trainer = request.getfixturevalue("transfer") if path == "transfer-round" else None
    tensors = len(states["B"])
    for which in ("B", "A"):
        result = PATHS[path](client, states[which], f"{path}-{which}", trainer)
        (rank,) = result.ranks
        # Both workers loaded every tensor: the rank's count is what every worker loaded.
        assert rank.tensors_loaded == tensors, rank
        assert [(w.worker_rank, w.tensors_loaded, w.weights_modified, w.error_cause) for w in rank.workers] == [
            (w, tensors, True, "") for w in range(TP)
        ], rank
        assert client.get_weight_version().version == f"{path}-{which}"
        tokens, digests = reference[which]
        assert worker_digests(client) == digests  # each worker's shard is the disk load's
        assert greedy_tokens(weights_server) == tokens


def test_a_disk_update_is_reported_per_worker(
    client: TrainerClient, checkpoints: Checkpoints, reference: dict[str, tuple[list[int], tuple[str, ...]]]
) -> None:
    nbytes = checkpoints.file("A").stat().st_size
    result = client.update_weights_from_disk(str(checkpoints.a), "disk-A-again", timeout=60)
    (rank,) = result.ranks
    assert [w.worker_rank for w in rank.workers] == list(range(TP))
    # The checkpoint's bytes once (what every worker loaded), not once per worker.
    assert 0 < rank.bytes_loaded < nbytes and all(w.bytes_loaded == rank.bytes_loaded for w in rank.workers)
    assert worker_digests(client) == reference["A"][1]


def test_a_cancelled_tensor_stream_stops_both_workers(
    weights_server: ServeProcess,
    stubs: Stubs,
    client: TrainerClient,
    checkpoints: Checkpoints,
    reference: dict[str, tuple[list[int], tuple[str, ...]]],
) -> None:
    """The abort reaches each worker on its own channel: both end cancelled (the Operation ends
    only once every worker's load returned), and the next update runs on both at once."""
    child, name = stalled_stream(weights_server, stubs, checkpoints.file("B"), 0)
    with child:
        client.cancel_operation(name)
        op = stubs.finished(name)
        child.kill()
    assert failure(op)[1] == "UPDATE_CANCELLED", failure(op)
    (rank,) = metadata(op).ranks
    assert [(w.worker_rank, w.error_cause, w.weights_modified) for w in rank.workers] == [
        (w, "UPDATE_CANCELLED", False) for w in range(TP)
    ], rank
    assert client.get_weight_version().version.startswith("disk-A")  # nothing written, nothing recorded
    assert greedy_tokens(weights_server) == reference["A"][0]
    client.update_weights_from_disk(str(checkpoints.a), "after-cancel", timeout=60)
    assert worker_digests(client) == reference["A"][1]


def test_a_stream_broken_mid_way_is_partial_on_both_workers(
    weights_server: ServeProcess,
    stubs: Stubs,
    client: TrainerClient,
    checkpoints: Checkpoints,
    reference: dict[str, tuple[list[int], tuple[str, ...]]],
) -> None:
    """Each worker received the same bytes before the break, so each wrote the same tensors:
    the update is partial on both (quarantine), and the next full update repairs both."""
    child, name = stalled_stream(weights_server, stubs, checkpoints.file("B"), 600_000)
    with child:
        child.kill()
    op = stubs.finished(name)
    assert failure(op)[1:] == ("PARTIAL_UPDATE", "STREAM_BROKEN"), failure(op)
    (rank,) = metadata(op).ranks
    loaded = {w.tensors_loaded for w in rank.workers}
    assert [(w.worker_rank, w.weights_modified) for w in rank.workers] == [(w, True) for w in range(TP)], rank
    assert len(loaded) == 1 and 0 < loaded.pop() < len(checkpoints.state_dict("B")), rank
    assert_partial(stubs, op, "STREAM_BROKEN")
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True))
    client.update_weights_from_tensors(checkpoints.state_dict("A"), "repaired", timeout=60)
    assert worker_digests(client) == reference["A"][1]
    assert greedy_tokens(weights_server) == reference["A"][0]


def test_server_info_counts_every_worker(weights_server: ServeProcess, client: TrainerClient) -> None:
    (bind,) = [e for e in weights_server.events() if e.get("event") == "cpu threads bind default"]
    assert (bind["workers"], len(bind["value"].split("|"))) == (TP, TP), bind
    info = client.get_server_info()
    assert (info.data_parallel_size, info.tensor_parallel_size, info.num_workers) == (1, TP, TP)
    with urllib.request.urlopen(f"{weights_server.http_url}/get_world_size", timeout=30) as response:
        assert response.status == 200


def test_the_cli_shows_each_worker(weights_server: ServeProcess, checkpoints: Checkpoints) -> None:
    """`enginectl weights load` and `verify --full` list a row per worker (a table when asked
    for one; JSON in a pipe carries the same `workers`)."""
    import json
    import subprocess

    from support.serving import BIN, base_env

    def cli(*words: str) -> str:
        done = subprocess.run(
            [str(BIN / "enginectl"), "--target", weights_server.grpc_target, *words],
            capture_output=True,
            text=True,
            timeout=120,
            env=base_env(),
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    loaded = json.loads(cli("-o", "json", "weights", "load", str(checkpoints.a), "--version", "cli-A"))
    assert [w["worker_rank"] for w in loaded["ranks"][0]["workers"]] == list(range(TP)), loaded
    table = cli("-o", "table", "weights", "verify", "--full")
    assert "WORKER" in table and table.count("MATCH") >= TP + 1, table
