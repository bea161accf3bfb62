"""`enginectl serve --headless`: a node that runs only EngineCores of an engine whose head runs
elsewhere (server/headless.py, DESIGN §13).

Here both "nodes" share this host and its namespaces: the head `enginectl serve
--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address 127.0.0.1
--data-parallel-rpc-port P` runs rank 0, and `enginectl serve --headless ...
--data-parallel-start-rank 1` runs rank 1, whose EngineCore handshakes with the head over TCP as
a remote node's does. What this shows is that the node starts as enginectl (its EngineCore and
worker carry enginectl's scheduler and extension, so the head's control calls reach rank 1),
that it owns its children, and that the head's start-up census (server/census.py) lists both
ranks and refuses an engine whose ranks disagree. What crosses separate hosts (the relay and the update channels,
liveness) needs the two-node harness of DESIGN §13 and is not shown here.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from support.serving import BIN, READY_TIMEOUT_S, ServeProcess, alive
from support.weights import Checkpoints, generate_on_rank

import enginectl
from bench.lib import harness
from bench.lib.procs import free_port
from enginectl.client import TrainerClient

pytestmark = pytest.mark.slow

DP_FLAGS = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1"]


class HeadlessNode(harness.ServeProcess):
    """`enginectl serve --headless --log-json ARGS`: ready once its EngineCores started."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__([str(BIN / "enginectl"), "serve", "--headless", "--log-json", *args], env, keep_lines=True)

    def fail(self, message: str) -> Any:
        pytest.fail(message)


@pytest.fixture(scope="module")
def nodes(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[tuple[ServeProcess, HeadlessNode]]:
    rpc = ["--data-parallel-rpc-port", str(free_port())]
    head = ServeProcess(
        [*DP_FLAGS, *rpc, "--enable-scale-out", "--allow-weights-from", str(checkpoints.root)], serve_env
    )
    node = HeadlessNode([*DP_FLAGS, *rpc, "--data-parallel-start-rank", "1"], serve_env)
    head.start()
    node.start()
    try:
        head.wait_ready()
        yield head, node
    finally:
        node.kill()
        head.kill()


def test_the_headless_node_runs_rank_1_as_enginectl(
    nodes: tuple[ServeProcess, HeadlessNode], checkpoints: Checkpoints
) -> None:
    """A declaration stamps rank 1's outputs, an update loads on rank 1 (its worker has
    enginectl's extension) and VerifyWeights matches there, pause reaches it (its EngineCore
    runs enginectl's scheduler)."""
    head, node = nodes
    started = node.wait_for_event(lambda e: e.get("event") == "engine cores started")
    assert started["dp_ranks"] == [1]
    assert head.serving["dp_size"] == 2
    with TrainerClient(head.grpc_target, timeout=120.0) as c:
        info = c.get_server_info()  # the start-up census: both nodes share this host here
        assert [(r.dp_rank, r.local, r.num_workers, r.enginectl_scheduler) for r in info.ranks] == [
            (0, True, 1, True),
            (1, True, 1, True),
        ]
        assert {r.enginectl_version for r in info.ranks} == {enginectl.__version__}
        c.set_weight_version("headless-a")
        choice = generate_on_rank(head, 1)
        assert choice["weight_versions"][0]["version"] == "headless-a"
        result = c.update_weights_from_disk(str(checkpoints.b), "headless-B")
        assert [r.dp_rank for r in result.ranks] == [0, 1]
        assert all(r.tensors_loaded == len(checkpoints.state_dict("B")) for r in result.ranks)
        verified = c.verify_weights(full=True)
        assert verified.verdict == "MATCH" and [(r.dp_rank, r.verdict) for r in verified.ranks] == [
            (0, "MATCH"),
            (1, "MATCH"),
        ]
        assert generate_on_rank(head, 0)["token_ids"] == generate_on_rank(head, 1)["token_ids"]
        paused = c.pause_generation("keep")
        assert [(r.dp_rank, r.paused) for r in paused.state.ranks] == [(0, True), (1, True)]
        c.resume_generation()


def test_sigterm_stops_the_node_and_every_child(nodes: tuple[ServeProcess, HeadlessNode]) -> None:
    """Last: the node stops its EngineCore and worker and reaps them before it exits 0."""
    _, node = nodes
    children = node.descendants()
    assert any("EngineCore" in " ".join(p.cmdline() + [p.name()]) for p in children), children
    assert node.terminate() == 0, node.tail()
    assert not alive(children), [p.pid for p in alive(children)]


def test_a_rank_without_enginectls_scheduler_where_the_others_have_it_is_refused_at_start(
    serve_env: dict[str, str],
) -> None:
    """A node started with another scheduler (`--scheduler-cls` of vLLM's own): the head's
    start-up census (server/census.py) names rank 1 and why, and the head exits 1
    without ever serving. The node is stopped by the test: nothing tells it yet that its head
    is gone (liveness, DESIGN §13)."""
    rpc = ["--data-parallel-rpc-port", str(free_port())]
    head = ServeProcess([*DP_FLAGS, *rpc], serve_env)
    node = HeadlessNode(
        [
            *DP_FLAGS,
            *rpc,
            "--data-parallel-start-rank",
            "1",
            "--scheduler-cls",
            "vllm.v1.core.sched.scheduler.Scheduler",
        ],
        serve_env,
    )
    head.start()
    node.start()
    try:
        assert head.proc is not None
        assert head.proc.wait(READY_TIMEOUT_S) == 1, head.tail()
        head.exited.wait(30)
        tail = head.tail()
        assert "the engine's ranks disagree" in tail, tail
        # vLLM's scheduler builds no enginectl hooks on that EngineCore: its census call fails.
        assert "rank 1: no enginectl EngineCore utilities" in tail and "rank 0" not in tail.split("disagree")[-1]
        assert not [e for e in head.events() if e.get("event") == "serving"]
    finally:
        node.kill()
        head.kill()


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--data-parallel-hybrid-lb", "--data-parallel-address", "127.0.0.1"], "--data-parallel-hybrid-lb"),
        (["--data-parallel-size", "2"], "--data-parallel-address HEAD is required"),
    ],
    ids=["hybrid-lb", "no-head-address"],
)
def test_flags_a_headless_node_can_not_run_are_refused_before_anything_starts(
    serve_env: dict[str, str], flags: list[str], why: str
) -> None:
    done = subprocess.run(
        [str(BIN / "enginectl"), "serve", "--headless", *flags],
        env=serve_env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode != 0 and why in done.stderr, done.stderr[-2000:]
