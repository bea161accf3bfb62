"""A fleet of two real `enginectl serve` processes updated by one trainer (enginectl.client.Fleet;
docs/weights.md, "The fleet").

Both servers start on checkpoint A and may load A and B (the session's `checkpoints`). Server
Y runs with ENGINECTL_TEST_FAULT=commit-1,commit-3,report-lost-once: its first and third
commits fail after writing began (the second and third tests' commits; each test's repair is
the commit between), and its first stage never reports its end on the progress channel. Those are
fakes, and the only ones here: a commit reads tensors already in memory, and no real fault makes
it fail half-way on demand; a report lost in transit (ZMQ dropping a queued frame, a worker
giving up on a stalled server) is a race. The first three tests use them; every other fault is
real (a set already staged, a stale etag, a refused request). Tests run in order and each leaves both
servers serving A, running, SERVING, with nothing staged. Both serve vLLM's transfer engine
`gloo` (--weight-transfer-config), which the fleet drives as vLLM's trainer-side API's client.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fault_helpers import HEALTH_SERVICES, NOT_SERVING, SERVING, Child, health
from support.serving import BIN, ServeProcess
from support.weights import Checkpoints, WeightStubs, greedy_tokens, stop_server
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

from e2e.fleet_invariant import PROMPTS, Invariant, checkpoint_of, generate_ids
from enginectl.client import Client, Fleet, FleetCommitError, FleetStageError, Reason, TrainerClient
from enginectl.client.transfer_engine import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    StateDictSource,
    register,
)
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

FLEET_TRAINER = Path(__file__).parents[1] / "support" / "fleet_trainer_proc.py"


@pytest.fixture(scope="module")
def servers(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    args = ["--allow-weights-from", str(checkpoints.root), "--enable-scale-out"]
    args += ["--weight-transfer-config", '{"backend": "gloo"}']  # vLLM's flag: the `transfer` fixture's engine
    x = ServeProcess(args, dict(serve_env, VLLM_SERVER_DEV_MODE="1")).start()
    y = ServeProcess(
        args, dict(serve_env, VLLM_SERVER_DEV_MODE="1", ENGINECTL_TEST_FAULT="commit-1,commit-3,report-lost-once")
    ).start()
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
def transfer(fleet: Fleet, checkpoints: Checkpoints) -> Iterator[GlooTrainerWeightTransferEngine]:
    """vLLM's trainer-side API with the fleet as its weight-sync client: one init per server
    (each at its rank offset), one group, one broadcast of B feeding both servers' stages."""
    register()
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=0, world_size=fleet.transfer_world_size(), rank=0, timeout_s=60.0
        ),
        client=fleet,
        source=StateDictSource(checkpoints.state_dict("B")),
    )
    assert isinstance(engine, GlooTrainerWeightTransferEngine)
    yield engine
    engine.shutdown()
    fleet.shutdown_weight_transfer_engine()  # a server gone (the chaos test) answers an error, not raised


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
        if srv.exited.is_set():  # terminated by the chaos test
            continue
        with TrainerClient(srv.grpc_target, timeout=120.0) as c:
            staged = c.generation_state().staged
            if staged is not None:
                c.discard_staged_weights(staged.name, allow_missing=True)
            c.resume_generation(force=True)
            c.update_weights_from_disk(str(checkpoints.a), "A")


@contextlib.contextmanager
def fleet_group(fleet: Fleet, servers: tuple[ServeProcess, ...], name: str) -> Iterator[dict[str, int]]:
    """The fleet's group `name` inside the block (its rank offsets, by target), destroyed on
    every server after it."""
    offsets = fleet.init_weights_update_group(name, timeout=60)
    try:
        yield offsets
    finally:
        for srv in servers:
            with TrainerClient(srv.grpc_target) as c:
                c.destroy_weights_update_group(name, allow_missing=True)


def stubs(srv: ServeProcess) -> WeightStubs:
    return WeightStubs(srv)


def test_a_stage_whose_end_report_is_lost_still_ends(
    servers: tuple[ServeProcess, ServeProcess], checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    """The server asks the workers when the channel goes quiet; without that the stage would
    wait for the report until its timeout and fail UPDATE_TIMEOUT."""
    _, y = servers
    with TrainerClient(y.grpc_target, timeout=120.0) as c:
        staged = c.stage_weights_from_disk(str(checkpoints.b), "lost-report", timeout=60)
        assert staged.weight_version == "lost-report" and staged.tensors > 0
        assert c.generation_state().staged.name == staged.name
        assert c.discard_staged_weights(staged.name) == staged.bytes
    assert any(e.get("event") == "staging ended without every worker's report" for e in y.events())
    assert greedy_tokens(y) == tokens["A"]


def test_a_fresh_process_repairs_what_a_killed_trainer_left(
    servers: tuple[ServeProcess, ServeProcess], checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    """The trainer (tests/support/fleet_trainer_proc.py) commits a fleet update, Y's commit
    fails after writing began (Y's first injected fault), and the trainer dies before any
    repair. A Fleet built from the targets alone sees Y's quarantine, its last failure and the
    set it still holds (who staged it, when); `enginectl fleet repair`, another new process,
    brings Y to the version the servers name (docs/weights.md, "A trainer that restarts")."""
    x, y = servers
    targets = [s.grpc_target for s in servers]
    died = subprocess.run(
        [sys.executable, str(FLEET_TRAINER), ",".join(targets), str(checkpoints.b), "fleet-killed"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert died.returncode == 1, died.stderr[-3000:]
    assert json.loads(died.stdout.strip().splitlines()[-1])["outcomes"] == {
        x.grpc_target: "ok",
        y.grpc_target: "quarantined",
    }

    with Fleet(targets, timeout=120.0) as fresh:
        status = fresh.status()
    left = status.servers[y.grpc_target]
    assert left.quarantined and not left.serving and not status.servers[x.grpc_target].quarantined
    assert left.last_failure is not None and left.last_failure.reason == Reason.PARTIAL_UPDATE
    assert left.last_failure.attempted_version == "fleet-killed"
    assert left.staged is not None and left.staged.weight_version == "fleet-killed"
    assert left.staged.staged_by.startswith("ipv") and left.staged.stage_time is not None
    shown = enginectl(servers, "fleet", "status", "--targets", ",".join(targets))
    assert json.loads(shown.stdout)["servers"][y.grpc_target]["quarantined"] is True

    repaired = enginectl(servers, "fleet", "repair", "--targets", ",".join(targets))
    assert repaired.returncode == 0, (repaired.stderr, repaired.stdout)
    document = json.loads(repaired.stdout)
    assert (document["mode"], document["version"], list(document["servers"])) == (
        "repair",
        "fleet-killed",
        [y.grpc_target],
    )
    for srv in servers:
        assert stubs(srv).version().version == "fleet-killed" and not stubs(srv).state().paused
        assert health(stubs(srv)) == {name: SERVING for name in HEALTH_SERVICES}
        assert greedy_tokens(srv) == tokens["B"]
    with Fleet(targets, timeout=120.0) as fresh:
        assert fresh.status().consistent
        assert fresh.repair().outcomes == {}  # nothing left to do
        for verdict in fresh.verify(full=True).values():
            assert verdict.verdict == "MATCH"  # type: ignore[union-attr]


def test_a_failed_commit_quarantines_one_server_and_repair_brings_it_back(
    servers: tuple[ServeProcess, ServeProcess],
    fleet: Fleet,
    transfer: GlooTrainerWeightTransferEngine,
    tokens: dict[str, list[int]],
) -> None:
    """Staged through the servers' vLLM transfer engine (the `transfer` fixture), committed
    as every fleet stage: Y's commit fails after writing began and Y is quarantined."""
    x, y = servers
    transfer.send_weights(weight_version="fleet-1")
    stage = fleet.last_stage
    assert stage is not None and stage.version == "fleet-1"
    assert set(stage.staged) == {x.grpc_target, y.grpc_target} and stage.fingerprint is not None
    for srv in servers:  # staged, not applied
        assert greedy_tokens(srv) == tokens["A"]

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
    assert sy.version().source == wv.WEIGHT_SOURCE_TRANSFER_ENGINE
    assert health(sy) == {name: SERVING for name in HEALTH_SERVICES}
    assert greedy_tokens(y) == tokens["B"]
    assert fleet.status().consistent
    for verdict in fleet.verify(full=True).values():
        assert verdict.verdict == "MATCH"  # type: ignore[union-attr]


def test_one_broadcast_stages_both_servers(
    servers: tuple[ServeProcess, ServeProcess], fleet: Fleet, checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    with fleet_group(fleet, servers, "fleet-gloo") as offsets:
        assert sorted(offsets.values()) == [1, 2]  # one worker each, after the trainer's rank 0
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


def test_a_stage_failure_on_one_server_leaves_both_unchanged(
    servers: tuple[ServeProcess, ServeProcess],
    fleet: Fleet,
    transfer: GlooTrainerWeightTransferEngine,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
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
    with fleet_group(fleet, servers, "fleet-refused"):
        with pytest.raises(FleetStageError):
            fleet.stage_broadcast(checkpoints.state_dict("B"), "never")
        assert fleet.status().servers[x.grpc_target].staged is None
        for srv in servers:
            assert greedy_tokens(srv) == tokens["A"]

    # A transfer-engine round Y refuses: X's round is cancelled before anything is sent.
    with pytest.raises(FleetStageError) as refused:
        transfer.send_weights(weight_version="never")
    refusal = refused.value.outcomes[y.grpc_target].error
    assert refusal is not None and refusal.reason == Reason.STAGED_WEIGHTS_EXIST
    assert fleet.status().servers[x.grpc_target].staged is None
    for srv in servers:
        assert stubs(srv).version().etag == before[srv.grpc_target].etag
        assert greedy_tokens(srv) == tokens["A"]


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


def enginectl(servers: tuple[ServeProcess, ServeProcess], *words: str) -> subprocess.CompletedProcess[str]:
    """`enginectl WORDS` as a script runs it (stdout not a terminal: JSON); a command that
    hangs fails the test with both servers' last lines."""
    try:
        return subprocess.run(
            [str(BIN / "enginectl"), *words], capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        tails = "\n".join(f"--- {s.grpc_target}:\n{s.tail(40)}" for s in servers)
        pytest.fail(f"enginectl {' '.join(words)} hung: {exc.stderr!r}\n{tails}")


def test_cli_fleet_update_status_and_verify(
    servers: tuple[ServeProcess, ServeProcess], checkpoints: Checkpoints, tokens: dict[str, list[int]]
) -> None:
    targets = ",".join(s.grpc_target for s in servers)
    done = enginectl(servers, "fleet", "update", str(checkpoints.b), "--version", "cli-B", "--targets", targets)
    assert done.returncode == 0, (done.stderr, done.stdout)
    document = json.loads(done.stdout)
    assert document["ok"] and document["mode"] == "strict"
    assert {s["weight_version"]["version"] for s in document["servers"].values()} == {"cli-B"}
    for srv in servers:
        assert greedy_tokens(srv) == tokens["B"]

    status = enginectl(servers, "fleet", "status", "--targets", targets)
    assert status.returncode == 0, status.stderr
    servers_json = json.loads(status.stdout)["servers"]
    assert {t: (s["serving"], s["version"]["version"]) for t, s in servers_json.items()} == {
        srv.grpc_target: (True, "cli-B") for srv in servers
    }
    verify = enginectl(servers, "fleet", "verify", "--targets", targets, "--full")
    assert verify.returncode == 0, verify.stderr
    assert {v["verdict"] for v in json.loads(verify.stdout).values()} == {"MATCH"}

    # A stage refused on one server: exit 1, every server's outcome printed, nothing changed.
    x, y = servers
    with TrainerClient(y.grpc_target) as c:
        c.stage_weights_from_disk(str(checkpoints.a))
    refused = enginectl(servers, "fleet", "update", str(checkpoints.a), "--version", "cli-A", "--targets", targets)
    assert refused.returncode == 1
    outcome = json.loads(refused.stdout)
    assert outcome["step"] == "stage"
    assert outcome["servers"][x.grpc_target]["ok"]
    assert outcome["servers"][y.grpc_target]["error"]["reason"] == Reason.STAGED_WEIGHTS_EXIST
    assert "a stage failed" in refused.stderr
    for srv in servers:
        assert stubs(srv).version().version == "cli-B"
    # An unreachable server: status says so and exits 3.
    gone = enginectl(servers, "fleet", "status", "--targets", f"{x.grpc_target},127.0.0.1:1", "--timeout", "5")
    assert gone.returncode == 3


# --- chaos ------------------------------------------------------------------------------------

CHAOS_SEED = 20261201
# Every kind of step at least once, in an order the seed shuffles (the first and last stay
# updates, so the run starts and ends by moving the fleet).
CHAOS_MIDDLE = [
    "update-loose",
    "trainer-killed",
    "identity",
    "stage-discarded",
    "stage-cancelled",
    "sigterm",
    "update",
    "identity",
]


def test_chaos_keeps_the_fleet_invariant(
    servers: tuple[ServeProcess, ServeProcess],
    serve_env: dict[str, str],
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
) -> None:
    rng = random.Random(CHAOS_SEED)
    steps = ["update", *rng.sample(CHAOS_MIDDLE, len(CHAOS_MIDDLE)), "update"]
    members = {s.grpc_target: s for s in servers}
    x = servers[0]
    references: dict[tuple[str, int], list[int]] = {}
    with TrainerClient(x.grpc_target, timeout=120.0) as c:  # every prompt's tokens under B, then A
        for which, path in (("B", checkpoints.b), ("A", checkpoints.a)):
            c.update_weights_from_disk(str(path), which)
            references |= {(which, i): generate_ids(x, p)["token_ids"] for i, p in enumerate(PROMPTS)}
    with Fleet(list(members), timeout=120.0) as fleet:  # the fleet starts on A, declared "A"
        try:
            fleet.update_from_disk(str(checkpoints.a), "A")
        except FleetCommitError:
            fleet.repair()
    invariant = Invariant(references)
    started: list[ServeProcess] = []  # replacements this test started (stopped at the end)
    stop = threading.Event()

    def watch() -> None:  # observes continuously while steps run
        while not stop.is_set():
            invariant.observe(members.copy())

    def roll() -> None:  # rollouts on every member while steps run
        while not stop.is_set():
            for target, srv in members.copy().items():
                if target in invariant.joining:
                    continue
                i = rng.randrange(len(PROMPTS))
                try:
                    choice = generate_ids(srv, PROMPTS[i])
                except OSError:
                    continue  # a server being terminated
                invariant.check_output(choice, i)

    threads = [threading.Thread(target=watch, daemon=True), threading.Thread(target=roll, daemon=True)]
    for t in threads:
        t.start()
    try:
        for number, step in enumerate(steps):
            fleet = Fleet(list(members), timeout=120.0)
            try:
                run_step(step, number, fleet, members, invariant, serve_env, checkpoints, started)
            finally:
                fleet.close()
            invariant.settled(members)
            assert not invariant.violations, (step, invariant.violations[:5])
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        for srv in started:
            stop_server(srv)
    assert not invariant.violations, invariant.violations[:5]
    assert invariant.outputs > len(steps)


def run_step(
    step: str,
    number: int,
    fleet: Fleet,
    members: dict[str, ServeProcess],
    invariant: Invariant,
    serve_env: dict[str, str],
    checkpoints: Checkpoints,
    started: list[ServeProcess],
) -> None:
    """One chaos step; leaves every member settled on `invariant.version`."""
    other = "B" if checkpoint_of(invariant.version) == "A" else "A"
    path = str(checkpoints.b if other == "B" else checkpoints.a)
    new = f"{other}:{number}"
    if step in ("update", "update-loose"):
        invariant.strict = step == "update"
        invariant.declared.add(new)
        try:
            fleet.update_from_disk(path, new, mode="strict" if invariant.strict else "loose")
        except FleetCommitError:  # a quarantined server (NOT_SERVING) until repaired
            fleet.repair()
        invariant.version = new
        invariant.strict = True
    elif step == "stage-discarded":
        stage = fleet.stage_from_disk(path, new)
        fleet.discard(stage)
    elif step == "stage-cancelled":  # CancelOperation of one server's stage, whenever it lands
        with TrainerClient(next(iter(members))) as c:
            op = c.start_stage_from_disk(path, new)
            c.cancel_operation(op.name)
            done = c.wait_operation(op.name)
        assert done.done and (done.error is None or done.error.reason == Reason.UPDATE_CANCELLED), done
        fleet.discard_staged()
    elif step == "trainer-killed":
        x, y = list(members)
        child = Child("fleet-stage", f"{x},{y}", str(checkpoints.file(other)), new, "300000")
        try:
            assert child.line()["staged"] == [x]
        finally:
            child.close()  # killed mid-stage: X holds its set, Y's stream broke
        fleet.discard_staged()  # the next trainer clears what the dead one staged
        for status in fleet.status().servers.values():
            assert status.staged is None
    elif step == "identity":
        target = list(members)[number % len(members)]
        with Client(target) as c:
            c.set_worker_identity(f"chaos-{number}")
    elif step == "sigterm":
        target, srv = list(members.items())[-1]
        assert srv.terminate() == 0
        replacement = ServeProcess(
            ["--allow-weights-from", str(checkpoints.root), "--enable-scale-out"],
            dict(serve_env, VLLM_SERVER_DEV_MODE="1"),
        ).start()
        started.append(replacement)
        replacement.wait_ready()
        invariant.joining.add(replacement.grpc_target)  # serving its own start, not the fleet's
        del members[target]
        members[replacement.grpc_target] = replacement
        with Fleet([replacement.grpc_target], timeout=120.0) as joining:
            joining.update_from_disk(
                str(checkpoints.a if checkpoint_of(invariant.version) == "A" else checkpoints.b), invariant.version
            )
        invariant.joining.discard(replacement.grpc_target)
    else:
        raise AssertionError(step)
