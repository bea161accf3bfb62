"""The runnable examples in examples/, each run as a subprocess against real servers.

- rl_loop.py on the session's `weights_server` (its weights may change; the test loads
  checkpoint A again afterwards, as the weight tests expect);
- grpcurl_walkthrough.sh on a server of this module started with `--await-worker-id` (the
  one extra engine these tests start), which the walkthrough gives its identity;
- planner_follow.py on that server (by then identified) and the session's `server` (which
  has no worker id, so its samples are unattributed);
- smg_rl_step.py on its own: it starts a real smg and two servers registered with it, and
  stops and reaps them (about 80 s here, most of it the two engine starts).

Tests run in file order: the walkthrough must find the awaiting server still without an
identity. Every subprocess is bounded by a timeout; assertions read the example's output and
then the servers' own answers over gRPC.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from support.serving import READY_TIMEOUT_S, ServeProcess
from support.weights import Checkpoints

from enginectl.client import TrainerClient, WeightSource
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT_S = 300.0
WORKER_ID = "example-worker"


def run_example(args: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT_S) -> str:
    """Run an example to its end; its stdout (stderr too in the failure message)."""
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:2]} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def identity(target: str) -> id_pb2.GetWorkerIdentityResponse:
    with grpc.insecure_channel(target) as channel:
        stub = id_grpc.FpmIdentityServiceStub(channel)
        answer: id_pb2.GetWorkerIdentityResponse = stub.GetWorkerIdentity(id_pb2.GetWorkerIdentityRequest(), timeout=60)
    return answer


@pytest.fixture(scope="module")
def awaiting(serve_env: dict[str, str]) -> Iterator[str]:
    """gRPC target of a server started with --await-worker-id (quick heartbeats)."""
    srv = ServeProcess(["--await-worker-id", "--fpm-heartbeat-interval", "0.25"], serve_env).start()
    try:
        event = srv.wait_for_event(lambda e: e.get("event") == "awaiting_worker_id", timeout=READY_TIMEOUT_S)
        yield f"127.0.0.1:{event['grpc_port']}"
    finally:
        try:
            if srv.proc is not None and srv.proc.poll() is None:
                srv.terminate()
        finally:
            srv.kill()


def test_rl_loop_pushes_each_step_by_both_paths_and_keeps_its_rollouts(
    weights_server: ServeProcess, checkpoints: Checkpoints, serve_env: dict[str, str]
) -> None:
    cmd = [sys.executable, str(EXAMPLES / "rl_loop.py"), "--grpc", weights_server.grpc_target]
    cmd += ["--http", f"127.0.0.1:{weights_server.http_port}", "--steps", "3"]
    with TrainerClient(weights_server.grpc_target, timeout=120.0) as client:
        try:
            out = run_example(cmd, serve_env)
            served = client.get_weight_version()
            verdict = client.verify_weights().verdict
        finally:
            client.update_weights_from_disk(str(checkpoints.a), "A")  # as the weight tests expect
    steps = re.findall(
        r"^step (\d): pushed (step-\d) via (tensor stream|gloo) .*; (\d+) rollouts under (step-\d),", out, re.M
    )
    # Each step declared its own version, alternating the two paths; the batch rolled out after
    # a push is generated entirely by it (stragglers that spanned a push are the ones dropped).
    assert steps == [
        ("1", "step-1", "tensor stream", "8", "step-1"),
        ("2", "step-2", "gloo", "8", "step-2"),
        ("3", "step-3", "tensor stream", "8", "step-3"),
    ], out
    assert "server serves step-3" in out and "VerifyWeights MATCH" in out, out
    assert (served.declared, served.version, served.source) == (True, "step-3", WeightSource.TENSORS)
    assert verdict == "MATCH"


def test_grpcurl_walkthrough_declares_a_version_and_identifies_an_awaiting_engine(
    awaiting: str, serve_env: dict[str, str]
) -> None:
    env = dict(serve_env, VERSION="example-v", WORKER_ID=WORKER_ID, FPM_SECONDS="5")
    out = run_example(["bash", str(EXAMPLES / "grpcurl_walkthrough.sh"), awaiting], env, timeout=120)
    # (a) the declaration, its compare-and-set, the refused stale etag, the Watch replay
    assert '"version": "example-v-cas"' in out and '"reason":"ETAG_MISMATCH"' in out, out
    # (b) NOT_SERVING before the identity, SERVING after, samples stamped with it
    assert out.index('"status": "NOT_SERVING"') < out.index('"status": "SERVING"'), out
    samples = re.findall(r'"worker_id": "example-worker",\s+"counter_id"', out)
    assert len(samples) >= 1, out
    assert [(r.worker_id, r.identity_generation) for r in identity(awaiting).ranks] == [(WORKER_ID, 1)]


def test_planner_follow_reports_verdicts_for_two_servers(
    awaiting: str, server: ServeProcess, serve_env: dict[str, str]
) -> None:
    with grpc.insecure_channel(awaiting) as channel:  # a no-op when the walkthrough set it
        id_grpc.FpmIdentityServiceStub(channel).SetWorkerIdentity(
            id_pb2.SetWorkerIdentityRequest(worker_id=WORKER_ID, timeout=duration_pb2.Duration(seconds=30)),
            timeout=60,
        )
    targets = f"{awaiting},{server.grpc_target}"
    base = [sys.executable, str(EXAMPLES / "planner_follow.py"), "--targets", targets, "--seconds", "120"]
    for workers, verdict in [(WORKER_ID, "OK"), (f"{WORKER_ID},absent-worker", "WORKER_COUNT_MISMATCH")]:
        out = run_example([*base, "--workers", workers, "--events", "3"], serve_env)
        final = out[out.index("] final verdict") :]
        assert final.startswith(f"] final verdict {verdict}:"), out
        # Both servers' ranks, each with what it publishes as: never dropped silently.
        assert f"{awaiting} rank 0: worker {WORKER_ID} (generation " in final, out
        assert f"{server.grpc_target} rank 0: unattributed (worker id " in final, out
    assert "missing ['absent-worker']" in final, out


def test_smg_rl_step_pauses_loads_and_declares_on_both_servers_through_the_gateway(serve_env: dict[str, str]) -> None:
    version = "smg-step-1"
    out = run_example([sys.executable, str(EXAMPLES / "smg_rl_step.py"), "--version", version], serve_env)
    assert re.findall(r"^paused (\d+) of (\d+) worker", out, re.M) == [("2", "2")], out
    # smg.rl's fanout reached each server's HTTP RL routes, which loaded and declared.
    loaded = re.findall(
        rf"^update_weights_from_disk on \S+ \((grpc://\S+)\): HTTP 200, weights updated to {version},", out, re.M
    )
    assert len(set(loaded)) == 2, out
    # Each server moved SMG's label itself; SMG stamped it on every completion it routed.
    assert re.findall(r"system_fingerprint=(\S+) ", out) == [version] * 4, out
    rows = re.findall(rf"^  \S+ (grpc://\S+) health=ready weight_version={version} ", out, re.M)
    assert sorted(rows) == sorted(set(loaded)), out
    assert f"every one stamped {version}" in out, out
