"""Tier 1: one vLLM engine whose rank 1 runs on node B (bench/lib/two_node.py), every promise
of DESIGN §13 held on it (docs/multinode.md).

The head, `enginectl serve --data-parallel-size 2 --data-parallel-size-local 1
--data-parallel-address HEAD --data-parallel-rpc-port P`, runs rank 0 here; node B, in its own
network and mount namespaces with its own host name and an environment built from nothing, runs
`enginectl serve --headless ... --data-parallel-start-rank 1`. Its /tmp, /dev/shm and loopback
are its own, so an `ipc://` channel or a loopback address that would "work" on one host fails
here as it does across machines. The model and checkpoints A and B live in a folder both nodes
share (as NFS would); checkpoint C only in the head's /tmp.

One engine pair for the module; its tests run in file order, and the last one kills node B.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import grpc
import psutil
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.fpm_helpers import SampleStream
from support.serving import BIN, ServeProcess
from support.two_node import NODE_HOSTNAME, TwoNodes, shared_model, shared_root, two_nodes
from support.weights import Checkpoints, build_checkpoints, generate_on_rank

from bench.lib import harness
from bench.lib.procs import free_port
from enginectl.client import TrainerClient
from enginectl.client.errors import EnginectlError, from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WAIT_S = 120.0  # any one wait on the engine pair: far above what it takes
LIVENESS_S = 10.0  # the default bound (docs/multinode.md, "Liveness")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class NodeB(harness.ServeProcess):
    """`enginectl serve --headless --log-json ARGS` as node B."""

    def __init__(self, nodes: TwoNodes, args: list[str], cache: Path) -> None:
        command = nodes.wrap([str(BIN / "enginectl"), "serve", "--headless", "--log-json", *args])
        super().__init__(command, nodes.node_env(cache_dir=cache), name="node-b", keep_lines=True)

    def fail(self, message: str) -> NoReturn:
        pytest.fail(message)


class Pair:
    def __init__(self, nodes: TwoNodes, head: ServeProcess, node: NodeB, checkpoints: Checkpoints, c: Path) -> None:
        self.nodes, self.head, self.node, self.checkpoints, self.head_only = nodes, head, node, checkpoints, c


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    with two_nodes() as made:
        yield made


@pytest.fixture(scope="module")
def pair(
    nodes: TwoNodes, serve_env: dict[str, str], request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    shared = shared_root(request.config)
    shared_model(shared)
    cache = shared / "enginectl-cache"
    head_env = nodes.head_env({**serve_env, "ENGINECTL_CACHE_DIR": str(cache)})
    weights = shared / f"weights-{uuid.uuid4().hex[:8]}"
    checkpoints = build_checkpoints(head_env, weights)
    head_only = tmp_path_factory.mktemp("head-only")  # under the head's /tmp: node B's is its own
    shutil.copytree(checkpoints.b, head_only / "C")
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", nodes.head_address, "--data-parallel-rpc-port", str(free_port())]
    dp += ["--weight-transfer-config", '{"backend": "gloo"}']  # vLLM's transfer engine on every rank
    head = ServeProcess(
        [*dp, "--enable-scale-out", "--allow-weights-from", str(weights), "--allow-weights-from", str(head_only)],
        head_env,
    )
    node = NodeB(nodes, [*dp, "--data-parallel-start-rank", "1"], cache)
    head.start()
    node.start()
    assert node.proc is not None
    nodes.track(node.proc)
    try:
        head.wait_ready()
        yield Pair(nodes, head, node, checkpoints, head_only / "C")
    finally:
        node.kill()
        head.kill()
        shutil.rmtree(weights, ignore_errors=True)


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_the_census_places_rank_1_on_node_b(pair: Pair) -> None:
    with TrainerClient(pair.head.grpc_target, timeout=60.0) as c:
        info = c.get_server_info()
    assert [(r.dp_rank, r.local, r.enginectl_scheduler) for r in info.ranks] == [(0, True, True), (1, False, True)]
    assert info.ranks[1].host == NODE_HOSTNAME
    assert info.ranks[0].host != NODE_HOSTNAME
    assert "ipc" not in info.backends  # a trainer's IPC handles can not reach node B's worker


def test_fpm_samples_of_both_ranks_carry_the_worker_id_set_after_start(pair: Pair) -> None:
    """Rank 1's publisher, on node B, got the relay's TCP endpoint and the start's key by
    utility (its environment has neither); after SetWorkerIdentity both ranks' samples carry
    the id and its generation."""
    stream = SampleStream(pair.head.grpc_target)
    try:
        stream.wait_for(lambda s: {x.dp_rank for x in s} == {0, 1})
        with grpc.insecure_channel(pair.head.grpc_target) as channel:
            ack = id_grpc.FpmIdentityServiceStub(channel).SetWorkerIdentity(
                id_pb2.SetWorkerIdentityRequest(worker_id="two-node-w"), timeout=60
            )
        assert [(r.dp_rank, r.worker_id) for r in ack.ranks] == [(0, "two-node-w"), (1, "two-node-w")], ack
        generation = ack.ranks[1].identity_generation
        assert generation > 0 and ack.ranks[0].identity_generation == generation
        generate_on_rank(pair.head, 1)

        def stamped(samples: list[fpm_pb2.ForwardPassMetrics]) -> bool:
            seen = {
                (x.dp_rank, x.kind)
                for x in samples
                if (x.worker_id, x.identity_generation) == ("two-node-w", generation)
            }
            return {
                (0, fpm_pb2.SAMPLE_KIND_HEARTBEAT),
                (1, fpm_pb2.SAMPLE_KIND_HEARTBEAT),
                (1, fpm_pb2.SAMPLE_KIND_STEP),
            } <= seen

        stream.wait_for(stamped)
    finally:
        stream.close()


def test_tensor_stream_disk_and_broadcast_updates_reach_rank_1(pair: Pair) -> None:
    """Each path loads on both ranks (per-rank results), VerifyWeights matches on both, and
    rank 1 generates what rank 0 does; A restores the first tokens."""
    checkpoints = pair.checkpoints
    before = generate_on_rank(pair.head, 1)["token_ids"]
    count = len(checkpoints.state_dict("B"))
    with TrainerClient(pair.head.grpc_target, timeout=WAIT_S) as c:

        def loaded(result: Any, version: str) -> None:
            assert [(r.dp_rank, r.tensors_loaded) for r in result.ranks] == [(0, count), (1, count)], result
            verified = c.verify_weights(full=True)
            assert [(r.dp_rank, r.verdict) for r in verified.ranks] == [(0, "MATCH"), (1, "MATCH")], verified
            assert c.get_weight_version().version == version

        loaded(c.update_weights_from_tensors(checkpoints.state_dict("B"), "stream-B", timeout=WAIT_S), "stream-B")
        after_b = generate_on_rank(pair.head, 1)["token_ids"]
        assert after_b != before and after_b == generate_on_rank(pair.head, 0)["token_ids"]
        loaded(c.update_weights_from_disk(str(checkpoints.a), "disk-A", timeout=WAIT_S), "disk-A")
        assert generate_on_rank(pair.head, 1)["token_ids"] == before
        c.init_weights_update_group("two-node", master_address=pair.nodes.head_address, timeout=60)
        try:
            loaded(
                c.broadcast_weights(checkpoints.state_dict("B"), "bcast-B", group_name="two-node", timeout=WAIT_S),
                "bcast-B",
            )
        finally:
            c.destroy_weights_update_group("two-node", allow_missing=True)
        assert generate_on_rank(pair.head, 1)["token_ids"] == after_b
        paused = c.pause_generation("keep")
        assert [(r.dp_rank, r.paused) for r in paused.state.ranks] == [(0, True), (1, True)]
        resumed = c.resume_generation()
        assert [r.paused for r in resumed.ranks] == [False, False]


def test_a_checkpoint_only_the_head_holds_is_refused_before_any_write(pair: Pair) -> None:
    with TrainerClient(pair.head.grpc_target, timeout=WAIT_S) as c:
        version, digests = c.get_weight_version().version, [r.current_digest for r in c.verify_weights(full=True).ranks]
        with pytest.raises(EnginectlError) as refused:
            c.update_weights_from_disk(str(pair.head_only), "head-only", timeout=WAIT_S)
        assert (refused.value.code, refused.value.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "CHECKPOINT_NOT_ON_RANK",
        )
        assert "rank 1" in refused.value.message and NODE_HOSTNAME in refused.value.message, refused.value.message
        assert c.get_weight_version().version == version
        assert [r.current_digest for r in c.verify_weights(full=True).ranks] == digests
    assert health(pair.head.grpc_target) == SERVING  # not quarantined, still serving
    generate_on_rank(pair.head, 1)


def test_a_broadcast_whose_master_is_the_heads_loopback_is_refused_before_anything_joins(pair: Pair) -> None:
    """Refused twice over: the trainer client sees rank 1's host differ from its own
    (RankInfo.host_id) and hosts nothing; a client that does not look (a raw gRPC call, as
    grpcurl makes) is refused by the server before any worker joins."""
    with TrainerClient(pair.head.grpc_target, timeout=WAIT_S) as c:
        with pytest.raises(EnginectlError) as refused:
            c.init_weights_update_group("loopback", master_address="127.0.0.1", timeout=30)
        assert (refused.value.code, refused.value.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "MASTER_ADDRESS_LOOPBACK",
        )
        assert "rank 1 on node-b" in refused.value.message, refused.value.message
    request = upb.InitWeightsUpdateGroupRequest(
        group_name="raw-loopback",
        master_address="127.0.0.1",
        master_port=29999,
        rank_offset=1,
        world_size=3,
        backend=upb.GROUP_BACKEND_GLOO,
    )
    with grpc.insecure_channel(pair.head.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            upb_grpc.WeightUpdateServiceStub(channel).InitWeightsUpdateGroup(request, timeout=60)
    error = from_rpc_error(raw.value)
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MASTER_ADDRESS_LOOPBACK"), error
    # vLLM's transfer-engine init, as vLLM's own trainer API sends it: refused alike, no worker asked.
    info = struct_pb2.Struct()
    info.update({"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 3})
    with grpc.insecure_channel(pair.head.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            upb_grpc.WeightUpdateServiceStub(channel).InitWeightTransferEngine(
                upb.InitWeightTransferEngineRequest(init_info=info), timeout=60
            )
    error = from_rpc_error(raw.value)
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MASTER_ADDRESS_LOOPBACK"), error
    assert "rank 1 on node-b" in error.message, error.message
    assert health(pair.head.grpc_target) == SERVING


def test_node_b_killed_is_an_engine_death_naming_rank_1(pair: Pair) -> None:
    """Last: node B's processes are killed at once (as a host that loses power). vLLM says
    nothing of a remote EngineCore's death; the head's rank watch finds rank 1 silent past the
    liveness bound: NOT_SERVING, and the head exits non-zero naming rank 1 and node B."""
    assert pair.node.proc is not None
    victims = [psutil.Process(pair.node.proc.pid), *pair.node.descendants()]
    for proc in victims:
        proc.kill()
    # The bound plus the watch's period, and slack for a loaded machine: not a timing test.
    died = pair.head.wait_for_event(lambda e: e.get("event") == "engine_dead", timeout=LIVENESS_S + 20)
    assert "rank 1" in died["cause"] and NODE_HOSTNAME in died["cause"], died
    assert pair.head.proc is not None
    assert pair.head.proc.wait(WAIT_S) != 0, pair.head.tail()
