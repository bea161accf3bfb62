"""Worker calls never outlive the timeout they are sent with (docs/architecture.md, "Worker
calls and their deadlines").

vLLM pairs a worker's answers with `collective_rpc` calls by order, so a worker method still
running when its call's timeout fires leaves a late answer that the next model step reads as
its output, and the engine dies. A trainer configured with the wrong port did exactly that:
InitWeightsUpdateGroup against a closed port, on a loaded machine, took 6-21 s for a 3 s
timeout (torch's store client retries its connect), the EngineCore's call timed out, and the
next step killed the engine with every rollout in flight.

- On the session's shared weights server (enginectl's real worker extension): five such
  calls in a row while two clients generate and a CPU burner loads the machine. Each answers
  DEADLINE_EXCEEDED GROUP_TIMEOUT within its timeout plus the stated margin, every completion
  succeeds, and the engine still serves.
- On a server of this module with a FAKE worker extension (tests/support/deadline_worker.py
  says why no real input can do it any more) whose group-join start overstays its timeout on
  purpose: a call whose late answer arrives within the grace is drained (the engine goes on,
  generation included, and answers in order afterwards); one whose answer never comes in time
  stops that EngineCore's executor and the server dies at once, saying why, rather than let a
  step misread the answer.

Nothing sleeps to wait: calls are bounded by gRPC deadlines, the exit by `wait(timeout)`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from support.deadline_worker import group_name
from support.fault_helpers import HEALTH_SERVICES, SERVING, health
from support.serving import ServeProcess, alive
from support.weights import WeightStubs, greedy_tokens

from enginectl.client.errors import EnginectlError, from_rpc_error
from enginectl.contract.engine import LATE_ANSWER_GRACE_S, QUICK_RPC_TIMEOUT_S
from enginectl.server.serve import ENGINE_DEAD_EXIT_CODE
from enginectl.server.weights.sources.groups import JOIN_MARGIN_S
from enginectl.weights.v1 import weight_update_service_pb2 as upb

pytestmark = pytest.mark.slow

CLOSED_PORT_TIMEOUT_S = 3.0
TRIES = 5
# What a call may take beyond its timeout + JOIN_MARGIN_S: the gRPC round trip itself, on a
# machine whose two cores are both busy.
CALL_SLACK_S = 1.5
TESTS = Path(__file__).resolve().parents[1]


def closed_port() -> int:
    """A loopback port nobody listens on (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_group(stubs: WeightStubs, name: str, port: int, timeout_s: float) -> tuple[float, EnginectlError | None]:
    """InitWeightsUpdateGroup against `port` (GLOO, the trainer at rank 0 and one engine
    worker); (seconds it took, its error or None)."""
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(timeout_s * 1e9))
    request = upb.InitWeightsUpdateGroupRequest(
        group_name=name,
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        backend=upb.GROUP_BACKEND_GLOO,
        timeout=timeout,
    )
    started = time.monotonic()
    try:
        stubs.updates.InitWeightsUpdateGroup(request, timeout=timeout_s + 120)
        return time.monotonic() - started, None
    except grpc.RpcError as exc:
        return time.monotonic() - started, from_rpc_error(exc)


class Rollouts:
    """`clients` threads generating completions of varied prompts through the HTTP API until
    stopped; each result is kept ("ok", or what went wrong)."""

    def __init__(self, server: ServeProcess, clients: int = 2) -> None:
        self._server = server
        self._stop = threading.Event()
        self.results: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Rollouts:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        assert not any(t.is_alive() for t in self._threads), "a completion did not end within 180 s"

    def _run(self, client: int) -> None:
        rng = random.Random(client)
        while not self._stop.is_set():
            prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 24))]
            body = {
                "model": self._server.served_model,
                "prompt": prompt,
                "max_tokens": rng.randrange(4, 24),
                "temperature": 0.7,
                "return_token_ids": True,
            }
            request = urllib.request.Request(
                f"{self._server.http_url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=150) as response:
                    tokens = json.load(response)["choices"][0]["token_ids"]
                result = "ok" if tokens else "no tokens"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                result = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.results.append(result)

    def failed(self) -> list[str]:
        with self._lock:
            return [r for r in self.results if r != "ok"]


class CpuBurner:
    """A process that keeps one core busy (bounded: it ends by itself after `limit_s`)."""

    def __init__(self, limit_s: float = 300.0) -> None:
        code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end:\n    pass\n"
        self._proc = subprocess.Popen([sys.executable, "-c", code])

    def __enter__(self) -> CpuBurner:
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait(30)


# --- enginectl's own worker extension -----------------------------------------------------


def test_a_closed_port_under_load_answers_within_its_deadline_and_rollouts_go_on(
    weights_server: ServeProcess,
) -> None:
    stubs = WeightStubs(weights_server)
    port = closed_port()
    bound = CLOSED_PORT_TIMEOUT_S + JOIN_MARGIN_S + CALL_SLACK_S
    answers: list[tuple[float, EnginectlError | None]] = []
    with CpuBurner(), Rollouts(weights_server) as rollouts:
        for i in range(TRIES):
            answers.append(init_group(stubs, f"wrong-port-{i}-{uuid.uuid4().hex[:6]}", port, CLOSED_PORT_TIMEOUT_S))
    for took, err in answers:
        assert err is not None, "a group joined a port nobody listens on"
        assert (err.code, err.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "GROUP_TIMEOUT"), err
        assert took <= bound, (took, bound, answers)
    assert len(rollouts.results) >= TRIES, rollouts.results  # generation ran through the calls
    assert rollouts.failed() == [], rollouts.failed()
    assert greedy_tokens(weights_server)  # the engine still serves
    assert health(stubs) == {name: SERVING for name in HEALTH_SERVICES}
    assert not stubs.state().paused


# --- a worker that overstays on purpose (a fake: tests/support/deadline_worker.py) ---------


@pytest.fixture(scope="module")
def late_server(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    env = dict(serve_env, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), serve_env.get("PYTHONPATH")])))
    srv = ServeProcess(["--worker-extension-cls", "support.deadline_worker.LateWorkerExtension"], env)
    srv.start().wait_ready()
    children = srv.descendants()
    yield srv
    try:
        srv.terminate()
    finally:
        srv.kill()
    assert not alive(children), f"children left behind: {alive(children)}"


def test_a_late_answer_that_arrives_is_drained_and_the_engine_goes_on(late_server: ServeProcess) -> None:
    stubs = WeightStubs(late_server)
    before = greedy_tokens(late_server)
    overstay = QUICK_RPC_TIMEOUT_S + 2  # past the EngineCore's bound, well inside its grace
    timeout = QUICK_RPC_TIMEOUT_S + LATE_ANSWER_GRACE_S  # the caller waits for the engine's word
    with Rollouts(late_server) as rollouts:
        took, err = init_group(stubs, group_name(overstay, uuid.uuid4().hex[:6]), closed_port(), timeout)
    assert err is not None
    assert (err.code, err.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "GROUP_TIMEOUT"), err
    assert "late answer was dropped" in err.message, err
    assert overstay <= took < timeout, took  # the drained answer ended it, not the caller's timeout
    # Generation waited while the EngineCore drained, then went on: every completion succeeded.
    assert rollouts.results and rollouts.failed() == [], rollouts.results
    # Answers are paired with their calls again: the same tokens, and a real closed-port join
    # answers as it should.
    assert greedy_tokens(late_server) == before
    took, err = init_group(stubs, f"after-{uuid.uuid4().hex[:6]}", closed_port(), CLOSED_PORT_TIMEOUT_S)
    assert err is not None and err.reason == "GROUP_TIMEOUT", err
    assert took <= CLOSED_PORT_TIMEOUT_S + JOIN_MARGIN_S + CALL_SLACK_S, took
    assert health(stubs) == {name: SERVING for name in HEALTH_SERVICES}


def test_a_late_answer_that_never_comes_stops_the_engine_and_says_why(late_server: ServeProcess) -> None:
    """Last in this module: the server exits."""
    stubs = WeightStubs(late_server)
    overstay = QUICK_RPC_TIMEOUT_S + LATE_ANSWER_GRACE_S + 30  # past the grace: never drained
    assert late_server.proc is not None
    took, err = init_group(stubs, group_name(overstay, uuid.uuid4().hex[:6]), closed_port(), 300.0)
    assert err is not None
    # The engine is dead from the moment its EngineCore gave up: the call says so (or met the
    # server's stop), long before the worker's answer would have come.
    assert err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
    assert took < overstay, took
    try:
        code = late_server.proc.wait(90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 90 s after its engine gave up:\n{late_server.tail(200)}")
    assert code == ENGINE_DEAD_EXIT_CODE != 0, late_server.tail()
    late_server.exited.wait(30)
    dead = [e for e in late_server.events() if e.get("event") == "engine_dead"]
    assert dead and "outlived" in dead[0]["cause"] and "enginectl_init_group" in dead[0]["cause"], late_server.tail()
    with pytest.raises(grpc.RpcError):
        health(stubs)  # nothing answers any more
