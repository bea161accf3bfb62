"""Tier 1, faults at the start and the end of a two-node engine (bench/lib/two_node.py,
docs/multinode.md): the head killed, and a node B that runs without enginectl's classes.

Each test starts its own head and node B (the pair of test_two_node_engine.py ends with node B
killed): rank 0 on the head, rank 1 on node B in its own network and mount namespaces.
"""

from __future__ import annotations

import psutil
import pytest
from support.serving import ServeProcess, alive
from support.two_node import TwoNodes, shared_model, shared_root, two_nodes

from bench.lib.procs import free_port
from e2e.multinode.test_two_node_engine import LIVENESS_S, WAIT_S, NodeB

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _pair(
    nodes: TwoNodes, serve_env: dict[str, str], request: pytest.FixtureRequest, *node_flags: str
) -> tuple[ServeProcess, NodeB]:
    shared = shared_root(request.config)
    shared_model(shared)
    cache = shared / "enginectl-cache"
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", nodes.head_address, "--data-parallel-rpc-port", str(free_port())]
    head = ServeProcess(dp, nodes.head_env({**serve_env, "ENGINECTL_CACHE_DIR": str(cache)}))
    node = NodeB(nodes, [*dp, "--data-parallel-start-rank", "1", *node_flags], cache)
    head.start()
    node.start()
    assert node.proc is not None
    nodes.track(node.proc)
    return head, node


def test_node_b_stops_when_its_head_is_killed(serve_env: dict[str, str], request: pytest.FixtureRequest) -> None:
    """The head and its EngineCore are killed at once (as a host that loses power): vLLM tells
    node B nothing, and its sockets stay open to nothing. Its rank's publisher finds the relay
    gone past the liveness bound and stops the EngineCore; `enginectl serve --headless` then
    stops and reaps the rest and exits non-zero."""
    with two_nodes() as nodes:
        head, node = _pair(nodes, serve_env, request)
        try:
            head.wait_ready()
            node.wait_for_event(lambda e: e.get("event") == "engine cores started")
            assert node.proc is not None and head.proc is not None
            children = node.descendants()
            for proc in [psutil.Process(head.proc.pid), *head.descendants()]:
                proc.kill()
            # The bound, the EngineCore's stop grace and the node's reaping, on a loaded machine.
            code = node.proc.wait(LIVENESS_S + WAIT_S)
            assert code != 0, node.tail()
            node.exited.wait(30)
            assert "this node stops its EngineCores" in node.tail(200), node.tail(200)
            assert not alive(children), [p.pid for p in alive(children)]
        finally:
            node.kill()
            head.kill()


def test_a_node_b_without_enginectls_scheduler_is_refused_at_start(
    serve_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    """Node B started with vLLM's own scheduler (what a `vllm serve --headless` node runs): the
    head's census names rank 1 and why, and the head exits 1 without ever serving."""
    with two_nodes() as nodes:
        head, node = _pair(nodes, serve_env, request, "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler")
        try:
            assert head.proc is not None
            assert head.proc.wait(WAIT_S * 2) == 1, head.tail()
            head.exited.wait(30)
            tail = head.tail()
            assert "the engine's ranks disagree" in tail and "rank 1: no enginectl EngineCore utilities" in tail, tail
            assert not [e for e in head.events() if e.get("event") == "serving"]
        finally:
            node.kill()
            head.kill()
