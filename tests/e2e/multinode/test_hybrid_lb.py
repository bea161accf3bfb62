"""One engine, one API server per node: vLLM's hybrid load balancing (docs/multinode.md, "One
server per node"), on the head and node B of bench/lib/two_node.py.

    head:   enginectl serve --data-parallel-size 4 --data-parallel-size-local 2
            --data-parallel-start-rank 0 --data-parallel-hybrid-lb
            --data-parallel-address HEAD --data-parallel-rpc-port P
    node B: the same with --data-parallel-start-rank 2, gRPC and HTTP on node B's address

Each node's enginectl manages its own two ranks (a dense model needs two per node: with one,
vLLM switches to external load balancing, which it refuses for dense models). A Fleet of the
two servers updates the engine: tensor stream, disk and one gloo broadcast, each with per-rank
results for all four ranks and VerifyWeights MATCH on each; each server registered itself with
an SMG gateway (`--gateway`) that shows the fleet's version on both; a planner over both sees
all four ranks' forward-pass metrics under the engine's one worker id; vLLM's trainer-side transfer API,
with the fleet as its client, stages and commits all four ranks. Without rank ranges a server
would open channels for all four ranks and wait on the two it never reaches, and the fleet's
group would count eight workers and never form.

One engine for the module; tests run in file order.
"""

from __future__ import annotations

import json
import secrets
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support.serving import ServeProcess, enginectl_cli
from support.smg import SmgGateway
from support.two_node import NODE_HOSTNAME, NodeServe, TwoNodes, shared_model, shared_root, two_nodes
from support.weights import Checkpoints, build_checkpoints, greedy_tokens
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

from bench.lib.procs import free_port
from enginectl.client import Fleet, PlannerThread, TrainerClient
from enginectl.client.client import ChannelConfig
from enginectl.client.rank_ranges import engine_coverage, expected_ranks
from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WAIT_S = 120.0


class Engine:
    def __init__(
        self,
        nodes: TwoNodes,
        head: ServeProcess,
        node: NodeServe,
        checkpoints: Checkpoints,
        token: str,
        smg: SmgGateway,
    ) -> None:
        self.nodes, self.head, self.node, self.checkpoints, self.token = nodes, head, node, checkpoints, token
        self.smg = smg

    @property
    def targets(self) -> list[str]:
        return [self.head.grpc_target, self.node.grpc_target]

    def fleet(self) -> Fleet:
        return Fleet(self.targets, token=self.token, timeout=WAIT_S)


@pytest.fixture(scope="module")
def engine(serve_env: dict[str, str], request: pytest.FixtureRequest) -> Iterator[Engine]:
    shared = shared_root(request.config)
    shared_model(shared)
    cache = shared / "enginectl-cache"
    weights = shared / f"weights-{uuid.uuid4().hex[:8]}"
    token = secrets.token_hex(16)
    with two_nodes() as nodes, SmgGateway(igw=True, health_check_interval_s=1, host=nodes.head_address).start() as smg:
        head_env = nodes.head_env({**serve_env, "ENGINECTL_CACHE_DIR": str(cache), "ENGINECTL_TOKEN": token})
        checkpoints = build_checkpoints(head_env, weights)
        dp = ["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-hybrid-lb"]
        dp += ["--data-parallel-address", nodes.head_address, "--data-parallel-rpc-port", str(free_port())]
        dp += ["--allow-weights-from", str(weights), "--gateway", smg.url]  # each node's server registers
        dp += ["--weight-transfer-config", '{"backend": "gloo"}']  # vLLM's flag: the last test's engine
        head = ServeProcess([*dp, "--data-parallel-start-rank", "0"], head_env).start()
        node = NodeServe(
            nodes, [*dp, "--data-parallel-start-rank", "2"], nodes.node_env(cache_dir=cache, ENGINECTL_TOKEN=token)
        ).start()
        try:
            head.wait_ready()
            node.wait_ready()
            yield Engine(nodes, head, node, checkpoints, token, smg)
        finally:
            node.kill()
            head.kill()
            shutil.rmtree(weights, ignore_errors=True)


def test_each_nodes_server_manages_its_own_two_ranks_of_the_one_engine(engine: Engine) -> None:
    infos = {}
    for target in engine.targets:
        with TrainerClient(target, token=engine.token, timeout=WAIT_S) as c:
            infos[target] = c.get_server_info()
    head, node = infos[engine.head.grpc_target], infos[engine.node.grpc_target]
    assert (head.data_parallel_size, head.managed_ranks, head.num_workers) == (4, range(0, 2), 2)
    assert (node.data_parallel_size, node.managed_ranks, node.num_workers) == (4, range(2, 4), 2)
    assert [(r.dp_rank, r.local) for r in head.ranks] == [(0, True), (1, True)]
    assert [(r.dp_rank, r.local, r.host) for r in node.ranks] == [(2, True, NODE_HOSTNAME), (3, True, NODE_HOSTNAME)]
    assert head.engine_id == node.engine_id and head.engine_id not in (head.incarnation, node.incarnation)
    shown = enginectl_cli("--target", engine.node.grpc_target, "-o", "json", "weights", "info", token=engine.token)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["managed_ranks"] == [2, 3]
    (covered,) = engine_coverage(infos)
    assert covered.ok and covered.servers == {
        engine.head.grpc_target: range(0, 2),
        engine.node.grpc_target: range(2, 4),
    }


def test_tensor_stream_disk_and_broadcast_through_a_fleet_reach_all_four_ranks(engine: Engine) -> None:
    checkpoints = engine.checkpoints
    count = len(checkpoints.state_dict("B"))
    before = greedy_tokens(engine.head)
    assert greedy_tokens(engine.node) == before
    ranks_of = {engine.head.grpc_target: [0, 1], engine.node.grpc_target: [2, 3]}
    with engine.fleet() as fleet:

        def loaded(commit: Any) -> None:
            assert {t: [(r.dp_rank, r.tensors_loaded) for r in o.result.ranks] for t, o in commit.outcomes.items()} == {
                t: [(r, count) for r in ranks] for t, ranks in ranks_of.items()
            }
            verified = fleet.verify(full=True)
            assert {t: [(r.dp_rank, r.verdict) for r in v.ranks] for t, v in verified.items()} == {
                t: [(r, "MATCH") for r in ranks] for t, ranks in ranks_of.items()
            }

        stage = fleet.stage_from_tensors(checkpoints.state_dict("B"), "stream-B", timeout=WAIT_S)
        loaded(fleet.commit(stage))
        after_b = greedy_tokens(engine.head)
        assert after_b != before and greedy_tokens(engine.node) == after_b
        loaded(fleet.update_from_disk(str(checkpoints.a), "disk-A"))
        assert greedy_tokens(engine.node) == before == greedy_tokens(engine.head)
        # One group of the trainer and the four workers: each server's window is its own two.
        offsets = fleet.init_weights_update_group("hybrid", master_address=engine.nodes.head_address, timeout=60)
        assert offsets == {engine.head.grpc_target: 1, engine.node.grpc_target: 3}
        try:
            loaded(fleet.commit(fleet.stage_broadcast(checkpoints.state_dict("B"), "bcast-B", timeout=WAIT_S)))
        finally:
            fleet.destroy_weights_update_group("hybrid")
        assert greedy_tokens(engine.node) == after_b == greedy_tokens(engine.head)
        # Paused and resumed together: each server answers for its own ranks.
        paused = fleet.pause_generation("keep")
        assert {t: [(r.dp_rank, r.paused) for r in p.state.ranks] for t, p in paused.items()} == {
            t: [(r, True) for r in ranks] for t, ranks in ranks_of.items()
        }
        resumed = fleet.resume_generation()
        assert all(not r.paused for state in resumed.values() for r in state.ranks)
        assert {s.version.version for s in fleet.status().servers.values() if s.version} == {"bcast-B"}


def test_each_nodes_server_is_a_worker_of_the_gateway_serving_the_fleets_version(engine: Engine) -> None:
    """Registered by `--gateway` on each node (SMG health-checks node B's gRPC at its address);
    the version the fleet declared reaches SMG's row of each."""
    urls = {f"grpc://{t}" for t in engine.targets}
    rows = engine.smg.wait_for(
        lambda rows: (
            {r["url"] for r in rows if r.get("weight_version") == "bcast-B" and r.get("health") == "ready"} >= urls
        ),
        timeout=30,
    )
    assert urls <= {r["url"] for r in rows}


def test_the_planner_sees_all_four_ranks_under_the_engines_one_worker_id(engine: Engine) -> None:
    servers = {}
    for target in engine.targets:
        with TrainerClient(target, token=engine.token, timeout=WAIT_S) as c:
            acks = c.set_worker_identity("hybrid-engine")
            servers[target] = ("hybrid-engine", c.get_server_info())
        assert [r.dp_rank for r in acks.ranks] == list(servers[target][1].managed_ranks)
    expected = expected_ranks(servers)
    assert expected.by_worker == {"hybrid-engine": (0, 1, 2, 3)} and not expected.problems
    endpoints = [ChannelConfig(target=t, token=engine.token) for t in engine.targets]
    with PlannerThread(endpoints) as planner:
        assert planner.wait_for(lambda p: p.reconcile(expected).ok, timeout=60), planner.reconcile(expected)
        assert planner.reconcile(expected).workers == {"hybrid-engine": (0, 1, 2, 3)}
    # The operator's view: `enginectl fpm top` over both nodes' servers, with the same token.
    top = enginectl_cli(
        *("fpm", "top", "--targets", ",".join(engine.targets), "--once", "--wait", "60"),
        *("--expect", "hybrid-engine", "-o", "json"),
        token=engine.token,
    )
    assert top.returncode == 0, top.stderr
    frame = json.loads(top.stdout)
    assert [(e["target"], e["data_parallel_size"], e["managed_ranks"]) for e in frame["endpoints"]] == [
        (engine.head.grpc_target, 4, [0, 1]),
        (engine.node.grpc_target, 4, [2, 3]),
    ]
    assert sorted((r["endpoint"], r["dp_rank"], r["worker_id"]) for r in frame["ranks"]) == sorted(
        [
            (engine.head.grpc_target, 0, "hybrid-engine"),
            (engine.head.grpc_target, 1, "hybrid-engine"),
            (engine.node.grpc_target, 2, "hybrid-engine"),
            (engine.node.grpc_target, 3, "hybrid-engine"),
        ]
    )
    assert frame["verdict"] == "OK", frame["detail"]


def test_vllms_trainer_api_through_the_fleet_stages_all_four_ranks(engine: Engine) -> None:
    """vLLM's trainer-side transfer API with the fleet as its client: each server's workers take
    the group ranks of its window (the server tells its workers where its ranks start), one
    broadcast stages both, the commit loads all four ranks."""
    register()
    with engine.fleet() as fleet:
        assert fleet.transfer_world_size() == 5  # the trainer and four workers, not 1 + 2 x 4
        trainer = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(
                master_address=engine.nodes.head_address, master_port=0, world_size=5, rank=0, timeout_s=60.0
            ),
            client=fleet,
            source=StateDictSource(engine.checkpoints.state_dict("A")),
        )
        try:
            trainer.send_weights(weight_version="transfer-A")
            stage = fleet.last_stage
            assert stage is not None and set(stage.staged) == set(engine.targets)
            commit = fleet.commit(stage)
        finally:
            trainer.shutdown()
            fleet.shutdown_weight_transfer_engine()
        assert {t: [r.dp_rank for r in o.result.ranks] for t, o in commit.outcomes.items() if o.result} == {
            engine.head.grpc_target: [0, 1],
            engine.node.grpc_target: [2, 3],
        }
        verified = fleet.verify(full=True)
        assert all(r.verdict == "MATCH" for v in verified.values() for r in v.ranks), verified
