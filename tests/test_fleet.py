"""A fleet of two real `enginectl serve` processes updated by one trainer (enginectl.client.Fleet;
docs/weights.md, "The fleet").

Both servers start on checkpoint A and may load A and B (the session's `checkpoints`). Server
Y runs with ENGINECTL_TEST_FAULT=commit-once: its first commit fails after writing began. That
is a fake, and the only one here: a commit reads tensors already in memory, and no real fault
makes it fail half-way on demand. The first test uses it; every other fault is real (a set
already staged, a stale etag, a refused request). Tests run in order and each leaves both
servers serving A, running, SERVING, with nothing staged.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from fault_helpers import HEALTH_SERVICES, NOT_SERVING, SERVING, health
from serving import BIN, ServeProcess
from weights_fixtures import Checkpoints, WeightStubs, greedy_tokens, stop_server

from enginectl.client import Fleet, FleetCommitError, FleetStageError, Reason, TrainerClient
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb


@pytest.fixture(scope="module")
def servers(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    args = ["--allow-weights-from", str(checkpoints.root), "--enable-scale-out"]
    x = ServeProcess(args, dict(serve_env, VLLM_SERVER_DEV_MODE="1")).start()
    y = ServeProcess(args, dict(serve_env, VLLM_SERVER_DEV_MODE="1", ENGINECTL_TEST_FAULT="commit-once")).start()
    try:
        x.wait_ready()
        y.wait_ready()
        yield x, y
    finally:
        for srv in (x, y):
            stop_server(srv)


@pytest.fixture(scope="module")
def fleet(servers: tuple[ServeProcess, ServeProcess]) -> Iterator[Fleet]:
    with Fleet([s.grpc_target for s in servers], timeout=120.0) as f:
        yield f


@pytest.fixture(scope="module")
def tokens(servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints) -> dict[str, list[int]]:
    """A's and B's greedy tokens (the same on both servers)."""
    x, _ = servers
    with TrainerClient(x.grpc_target, timeout=120.0) as c:
        c.update_weights_from_disk(str(checkpoints.b), "probe-B")
        b = greedy_tokens(x)
        c.update_weights_from_disk(str(checkpoints.a), "A")
        a = greedy_tokens(x)
    assert a != b
    return {"A": a, "B": b}


@pytest.fixture(autouse=True)
def back_to_a(
    servers: tuple[ServeProcess, ServeProcess], checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> Iterator[None]:
    yield
    for srv in servers:
        with TrainerClient(srv.grpc_target, timeout=120.0) as c:
            staged = c.generation_state().staged
            if staged is not None:
                c.discard_staged_weights(staged.name, allow_missing=True)
            c.resume_generation(force=True)
            c.update_weights_from_disk(str(checkpoints.a), "A")


def stubs(srv: ServeProcess) -> WeightStubs:
    return WeightStubs(srv)


def test_a_failed_commit_quarantines_one_server_and_repair_brings_it_back(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    x, y = servers
    stage = fleet.stage_from_disk(str(checkpoints.b), "fleet-1")
    assert set(stage.staged) == {x.grpc_target, y.grpc_target} and stage.fingerprint is not None

    with pytest.raises(FleetCommitError) as failed:
        fleet.commit(stage)
    outcomes = failed.value.outcomes
    assert outcomes[x.grpc_target].ok and outcomes[x.grpc_target].result is not None
    bad = outcomes[y.grpc_target]
    assert (bad.ok, bad.state, bad.error.reason if bad.error else None) == (False, "quarantined", Reason.PARTIAL_UPDATE)

    # X serves the new version; Y is out: paused, undeclared, NOT_SERVING on every service.
    assert greedy_tokens(x) == tokens["B"]
    sx, sy = stubs(x), stubs(y)
    assert sx.version().version == "fleet-1" and not sx.state().paused
    assert health(sx) == {name: SERVING for name in HEALTH_SERVICES}
    version_y = sy.version()
    assert not version_y.declared and version_y.last_failure.reason == Reason.PARTIAL_UPDATE
    assert sy.state().paused and sy.state().reason == upb.PAUSE_REASON_PARTIAL_UPDATE
    assert health(sy) == {name: NOT_SERVING for name in HEALTH_SERVICES}
    status = fleet.status()
    assert not status.consistent
    assert status.servers[x.grpc_target].serving and not status.servers[y.grpc_target].serving
    assert status.servers[y.grpc_target].staged is not None  # kept for the repair

    repaired = fleet.repair()
    assert repaired.ok and set(repaired.outcomes) == {y.grpc_target}
    assert sy.version().version == "fleet-1" and not sy.state().paused
    assert health(sy) == {name: SERVING for name in HEALTH_SERVICES}
    assert greedy_tokens(y) == tokens["B"]
    assert fleet.status().consistent
    for verdict in fleet.verify(full=True).values():
        assert verdict.verdict == "MATCH"  # type: ignore[union-attr]


def test_one_broadcast_stages_both_servers(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    offsets = fleet.init_weights_update_group("fleet-gloo", timeout=60)
    assert sorted(offsets.values()) == [1, 2]  # one worker each, after the trainer's rank 0
    try:
        stage = fleet.stage_broadcast(checkpoints.state_dict("B"), "fleet-gloo")
        assert stage.fingerprint is not None  # both staged the same bytes
        for srv in servers:  # staging changed nothing yet
            assert greedy_tokens(srv) == tokens["A"]
        commit = fleet.commit(stage)
        assert commit.ok and commit.mode == "strict"
        for srv in servers:
            assert greedy_tokens(srv) == tokens["B"]
            assert stubs(srv).version().version == "fleet-gloo"
        status = fleet.status()
        assert status.consistent and status.versions == {"fleet-gloo"}
    finally:
        for srv in servers:
            with TrainerClient(srv.grpc_target) as c:
                c.destroy_weights_update_group("fleet-gloo", allow_missing=True)


def test_a_stage_failure_on_one_server_leaves_both_unchanged(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    x, y = servers
    before = {s.grpc_target: stubs(s).version() for s in servers}
    with TrainerClient(y.grpc_target) as c:  # Y already holds a set: it refuses another
        own = c.stage_weights_from_disk(str(checkpoints.a))
    with pytest.raises(FleetStageError) as failed:
        fleet.stage_from_disk(str(checkpoints.b), "never")
    outcomes = failed.value.outcomes
    assert outcomes[x.grpc_target].ok
    assert outcomes[y.grpc_target].error is not None
    assert outcomes[y.grpc_target].error.reason == Reason.STAGED_WEIGHTS_EXIST
    status = fleet.status()
    assert status.servers[x.grpc_target].staged is None  # X's set was discarded
    staged_y = status.servers[y.grpc_target].staged
    assert staged_y is not None and staged_y.name == own.name  # Y's own set is not the fleet's to drop
    for srv in servers:
        after = stubs(srv).version()
        assert (after.version, after.etag) == (before[srv.grpc_target].version, before[srv.grpc_target].etag)
        assert greedy_tokens(srv) == tokens["A"]

    # A broadcast stage Y refuses: nothing is broadcast, X's stage is stopped and dropped.
    fleet.init_weights_update_group("fleet-refused", timeout=60)
    try:
        with pytest.raises(FleetStageError):
            fleet.stage_broadcast(checkpoints.state_dict("B"), "never")
        assert fleet.status().servers[x.grpc_target].staged is None
        for srv in servers:
            assert greedy_tokens(srv) == tokens["A"]
    finally:
        for srv in servers:
            with TrainerClient(srv.grpc_target) as c:
                c.destroy_weights_update_group("fleet-refused", allow_missing=True)


def test_a_commit_fenced_out_on_one_server_holds_it_until_repair(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    x, y = servers
    stage = fleet.stage_from_disk(str(checkpoints.b), "fleet-fenced")
    with TrainerClient(y.grpc_target) as c:  # another writer declares on Y meanwhile
        c.set_weight_version("someone-else")
    with pytest.raises(FleetCommitError) as failed:
        fleet.commit(stage)
    held = failed.value.outcomes[y.grpc_target]
    assert (held.state, held.error.reason if held.error else None) == ("held", Reason.ETAG_MISMATCH)
    # X moved; Y kept its weights and version, and is held paused (it generates nothing old).
    assert greedy_tokens(x) == tokens["B"]
    sy = stubs(y)
    assert sy.version().version == "someone-else" and sy.state().paused
    assert sy.versions.VerifyWeights(vpb.VerifyWeightsRequest()).verdict == vpb.VERIFY_VERDICT_MATCH

    fleet.repair()
    assert sy.version().version == "fleet-fenced" and not sy.state().paused
    assert greedy_tokens(y) == tokens["B"]
    assert fleet.status().consistent


def test_loose_commit_and_discard(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    stage = fleet.stage_from_tensors(checkpoints.state_dict("B"), "fleet-loose")
    fleet.discard(stage)
    assert all(s.staged is None for s in fleet.status().servers.values())
    for srv in servers:
        assert greedy_tokens(srv) == tokens["A"]
    commit = fleet.update_from_disk(str(checkpoints.b), "fleet-loose", mode="loose")
    assert commit.ok and commit.mode == "loose"
    for srv in servers:
        assert greedy_tokens(srv) == tokens["B"]
    with pytest.raises(ValueError):
        fleet.commit(mode="eventually")


# --- the CLI --------------------------------------------------------------------------------


def enginectl(*words: str) -> subprocess.CompletedProcess[str]:
    """`enginectl WORDS` as a script runs it (stdout not a terminal: JSON)."""
    return subprocess.run(
        [str(BIN / "enginectl"), *words], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def test_cli_fleet_update_status_and_verify(
    servers: tuple[ServeProcess, ServeProcess], checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    targets = ",".join(s.grpc_target for s in servers)
    done = enginectl("fleet", "update", str(checkpoints.b), "--version", "cli-B", "--targets", targets)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] and document["mode"] == "strict"
    assert {s["weight_version"]["version"] for s in document["servers"].values()} == {"cli-B"}
    for srv in servers:
        assert greedy_tokens(srv) == tokens["B"]

    status = enginectl("fleet", "status", "--targets", targets)
    assert status.returncode == 0, status.stderr
    servers_json = json.loads(status.stdout)["servers"]
    assert {t: (s["serving"], s["version"]["version"]) for t, s in servers_json.items()} == {
        srv.grpc_target: (True, "cli-B") for srv in servers
    }
    verify = enginectl("fleet", "verify", "--targets", targets, "--full")
    assert verify.returncode == 0, verify.stderr
    assert {v["verdict"] for v in json.loads(verify.stdout).values()} == {"MATCH"}

    # A stage refused on one server: exit 1, every server's outcome printed, nothing changed.
    x, y = servers
    with TrainerClient(y.grpc_target) as c:
        c.stage_weights_from_disk(str(checkpoints.a))
    refused = enginectl("fleet", "update", str(checkpoints.a), "--version", "cli-A", "--targets", targets)
    assert refused.returncode == 1
    outcome = json.loads(refused.stdout)
    assert outcome["step"] == "stage"
    assert outcome["servers"][x.grpc_target]["ok"]
    assert outcome["servers"][y.grpc_target]["error"]["reason"] == Reason.STAGED_WEIGHTS_EXIST
    assert "a stage failed" in refused.stderr
    for srv in servers:
        assert stubs(srv).version().version == "cli-B"
    # An unreachable server: status says so and exits 3.
    gone = enginectl("fleet", "status", "--targets", f"{x.grpc_target},127.0.0.1:1", "--timeout", "5")
    assert gone.returncode == 3
