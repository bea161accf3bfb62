"""A fleet whose servers live on other hosts (docs/multinode.md, "A fleet across hosts"): two
single-node `enginectl serve` processes, one on node-a and one on node-b (each in its own
network, mount and UTS namespaces, bench/lib/two_node.py), joined with this host by one bridge
as hosts on a switch. The trainer is this test process, on a third address (the bridge's);
gRPC listens on each node's address and asks for a bearer token, as a fleet across hosts must.

- a loopback broadcast master is refused by the Fleet at once, with the address to use
  instead, and nothing is hosted or joined;
- one gloo broadcast from here stages both servers, a staged commit applies it on both;
- node-b's first commit fails after writing began (ENGINECTL_TEST_FAULT=commit-1: a fake, as
  in tests/e2e/test_fleet.py, since no real fault fails a commit half-way on demand), node-b is
  quarantined and `Fleet.repair` brings it back;
- a planner over both, each server under its own worker id, reconciles OK from the servers'
  managed ranks.

One pair of servers for the module; tests run in file order.
"""

from __future__ import annotations

import json
import secrets
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from support.serving import base_env, enginectl_cli
from support.two_node import NodeServe, TwoNodes, bridged_nodes, shared_model, shared_root
from support.weights import Checkpoints, build_checkpoints, greedy_tokens

from enginectl.client import Fleet, FleetCommitError, PlannerThread, Reason, TrainerClient
from enginectl.client.client import ChannelConfig
from enginectl.client.errors import EnginectlError
from enginectl.client.rank_ranges import expected_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WAIT_S = 120.0


class Hosts:
    def __init__(self, trainer_address: str, a: NodeServe, b: NodeServe, checkpoints: Checkpoints, token: str) -> None:
        self.trainer_address, self.a, self.b, self.checkpoints, self.token = trainer_address, a, b, checkpoints, token

    @property
    def targets(self) -> list[str]:
        return [self.a.grpc_target, self.b.grpc_target]

    def client(self, server: NodeServe) -> TrainerClient:
        return TrainerClient(server.grpc_target, token=self.token, timeout=WAIT_S)


@pytest.fixture(scope="module")
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    shared = shared_root(request.config)
    shared_model(shared)
    cache = shared / "enginectl-cache"
    weights = shared / f"weights-{uuid.uuid4().hex[:8]}"
    checkpoints = build_checkpoints({**base_env(), "ENGINECTL_CACHE_DIR": str(cache)}, weights)
    token = secrets.token_hex(16)
    with bridged_nodes("node-a", "node-b") as (bridge, (node_a, node_b)):
        args = ["--allow-weights-from", str(weights)]

        def serve(node: TwoNodes, **extra: str) -> NodeServe:
            env = node.node_env(cache_dir=cache, ENGINECTL_TOKEN=token, **extra)
            return NodeServe(node, args, env).start()

        a, b = serve(node_a), serve(node_b, ENGINECTL_TEST_FAULT="commit-1")
        try:
            a.wait_ready()
            b.wait_ready()
            yield Hosts(bridge.address, a, b, checkpoints, token)
        finally:
            b.kill()
            a.kill()
            shutil.rmtree(weights, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(hosts: Hosts) -> Iterator[Fleet]:
    with Fleet(hosts.targets, token=hosts.token, timeout=WAIT_S) as made:
        yield made


def test_the_servers_run_on_two_other_hosts_each_managing_its_one_rank(hosts: Hosts) -> None:
    infos = {}
    for server in (hosts.a, hosts.b):
        with hosts.client(server) as c:
            infos[server.node.hostname] = c.get_server_info()
    assert {name: [r.host for r in i.ranks] for name, i in infos.items()} == {
        "node-a": ["node-a"],
        "node-b": ["node-b"],
    }
    assert all(i.managed_ranks == range(1) and i.auth_required for i in infos.values())
    assert infos["node-a"].engine_id != infos["node-b"].engine_id  # two engines


def test_a_loopback_master_is_refused_at_once_naming_the_address_to_use_and_nothing_joins(
    hosts: Hosts, fleet: Fleet
) -> None:
    with pytest.raises(EnginectlError) as refused:
        fleet.init_weights_update_group("loopback", master_address="127.0.0.1", timeout=600)
    err = refused.value
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.MASTER_ADDRESS_LOOPBACK)
    assert "rank 0 on node-a" in err.message and "rank 0 on node-b" in err.message, err.message
    assert f"master_address='{hosts.trainer_address}'" in err.message, err.message  # the route toward them
    # vLLM's transfer-engine init through the fleet: refused alike, before any server is asked.
    with pytest.raises(EnginectlError) as transfer:
        fleet.init_weight_transfer_engine({"master_address": "localhost", "master_port": 29500, "world_size": 3})
    assert transfer.value.reason == Reason.MASTER_ADDRESS_LOOPBACK, transfer.value
    for server in (hosts.a, hosts.b):
        with hosts.client(server) as c, pytest.raises(EnginectlError) as missing:
            c.destroy_weights_update_group("loopback")  # no server has (or is joining) the group
        assert missing.value.code == grpc.StatusCode.NOT_FOUND


def test_one_broadcast_from_a_third_address_stages_both_and_a_commit_with_a_failure_is_repaired(
    hosts: Hosts, fleet: Fleet
) -> None:
    """The trainer hosts the group on the bridge's address; node-a's and node-b's workers join
    it (ranks 1 and 2) and one broadcast stages both. node-b's commit fails after writing
    began: it is quarantined (NOT_SERVING, undeclared), node-a serves the new version, and
    repair commits node-b from the set it still holds."""
    a, b = hosts.a, hosts.b
    before = greedy_tokens(a)
    offsets = fleet.init_weights_update_group("hosts", master_address=hosts.trainer_address, timeout=60)
    assert offsets == {a.grpc_target: 1, b.grpc_target: 2}
    try:
        stage = fleet.stage_broadcast(hosts.checkpoints.state_dict("B"), "bcast-B", timeout=WAIT_S)
    finally:
        fleet.destroy_weights_update_group("hosts")
    assert set(stage.staged) == set(hosts.targets)
    assert greedy_tokens(a) == before == greedy_tokens(b)  # staged, not applied
    with pytest.raises(FleetCommitError) as failed:
        fleet.commit(stage)
    outcomes = failed.value.outcomes
    assert outcomes[a.grpc_target].ok
    bad = outcomes[b.grpc_target]
    assert (bad.ok, bad.state, bad.error.reason if bad.error else None) == (False, "quarantined", Reason.PARTIAL_UPDATE)
    status = fleet.status()
    assert status.servers[a.grpc_target].serving and not status.servers[b.grpc_target].serving
    assert status.servers[b.grpc_target].quarantined
    repaired = fleet.repair()
    assert repaired.ok and set(repaired.outcomes) == {b.grpc_target}
    assert fleet.status().consistent
    verified: dict[str, Any] = fleet.verify(full=True)
    assert {t: v.verdict for t, v in verified.items()} == {a.grpc_target: "MATCH", b.grpc_target: "MATCH"}
    after = greedy_tokens(a)
    assert after != before and greedy_tokens(b) == after
    for server in (a, b):
        with hosts.client(server) as c:
            assert c.get_weight_version().version == "bcast-B"
    # The operator's view from this host: `enginectl fleet status` over both, with the token.
    shown = enginectl_cli("-o", "json", "fleet", "status", "--targets", ",".join(hosts.targets), token=hosts.token)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["consistent"] is True
    assert {t: s["version"]["version"] for t, s in document["servers"].items()} == dict.fromkeys(
        hosts.targets, "bcast-B"
    )


def test_a_planner_over_both_hosts_reconciles_from_their_managed_ranks(hosts: Hosts) -> None:
    servers = {}
    for server, worker in ((hosts.a, "host-a"), (hosts.b, "host-b")):
        with hosts.client(server) as c:
            c.set_worker_identity(worker)
            servers[server.grpc_target] = (worker, c.get_server_info())
    expected = expected_ranks(servers)
    assert expected.by_worker == {"host-a": (0,), "host-b": (0,)} and not expected.problems
    endpoints = [ChannelConfig(target=t, token=hosts.token) for t in hosts.targets]
    with PlannerThread(endpoints) as planner:
        assert planner.wait_for(lambda p: p.reconcile(expected).ok, timeout=60), planner.reconcile(expected)
        judged = planner.reconcile(expected)
    assert judged.workers == {"host-a": (0,), "host-b": (0,)}
