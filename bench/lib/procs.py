"""Subprocesses of the benchmark: servers (bench/lib/harness.py's ServeProcess) and load generators.

Runs in the `python -m bench` process. A server is ready once it prints a JSON line whose
`event` is `serving` (enginectl's structlog line, or bench.lib.servers' own); no sleeps. The
plain vLLM API server (`vllm_server()`) prints none: it is ready once its `/health` answers 200.
`stop()` sends SIGTERM, waits, and checks that no descendant survived. A load generator (`Worker`)
speaks JSON lines on its stdin and stdout.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench.lib.harness import EXIT_TIMEOUT_S, READY_TIMEOUT_S, ServeProcess, alive, base_env, serve_command

REPO = Path(__file__).resolve().parents[2]
CHILD_GRACE_S = 10.0


def bench_env() -> dict[str, str]:
    """base_env() with the repository on PYTHONPATH, for `python -m bench.*` subprocesses."""
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def enginectl_server(extra_args: Sequence[str] = ()) -> ServeProcess:
    """`enginectl serve` on the embedded tiny model; VLLM_SERVER_DEV_MODE=1 exposes vLLM's
    RL routes (/weight_info) on its HTTP API."""
    env = base_env()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return ServeProcess(serve_command(extra_args), env)


def model_server(model: Path, extra_args: Sequence[str] = ()) -> ServeProcess:
    """`enginectl serve` on a synthetic checkpoint of bench/lib/checkpoints.py: float32, eager, a
    64 MiB KV cache (a user's model needs a memory flag on a busy host), seeded. vLLM's own
    /collective_rpc stays vLLM's (--allow-vllm-dev-routes): the weights phase's baselines are
    vLLM's reload_weights on the same server."""
    return enginectl_server(
        [
            "--allow-vllm-dev-routes",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--max-num-seqs",
            "8",
            "--seed",
            "0",
            *extra_args,
        ]
    )


class VllmServer(ServeProcess):
    """A plain vLLM API server: no `serving` line, so ready once `GET /health` answers 200."""

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServeProcess:
        """Poll `/health` until 200; kill the server and fail if it exits or the deadline passes."""
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        while True:
            try:
                if http_get_status(self.http_port, "/health") == 200:
                    break
            except OSError:  # not listening yet (refused), or reset while it starts
                pass
            exited = self.proc is None or self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                tail = self.tail()
                self.kill()
                why = "exited" if exited else f"timed out after {timeout:.0f}s"
                self.fail(f"{self.name} did not become ready ({why}):\n{tail}")
            self.exited.wait(0.25)  # a probe every quarter second; at once if it exits
        self.serving["ready_after_s"] = round(time.monotonic() - t0, 1)
        self.ready.set()  # from here the drain thread keeps only the tail of its output
        self._children = self.descendants()
        return self

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> dict[str, object]:
        """As ServeProcess.stop, but its descendants (the EngineCore, multiprocessing's resource
        tracker) get CHILD_GRACE_S to exit after it before any left is killed and reported."""
        if self.proc is None:
            return super().stop(timeout)
        self._children = list({p.pid: p for p in (*self._children, *self.descendants())}.values())
        t0 = time.monotonic()
        try:
            self._sigterm(timeout)
        except subprocess.TimeoutExpired:
            pass  # super().stop() kills it
        psutil.wait_procs(alive(self._children), timeout=CHILD_GRACE_S)
        out = super().stop(timeout)
        out["stop_s"] = round(time.monotonic() - t0, 2)
        return out


def free_port() -> int:
    """A port free on 127.0.0.1 now (vLLM's API server does not report the port it bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_server() -> VllmServer:
    """vLLM's own API server (`python -m vllm.entrypoints.openai.api_server`; the venv's `vllm`
    script looks up a `vllm` distribution, which the CPU build is not named) with
    VLLM_SERVER_DEV_MODE=1, so its RL routes (`/weight_info`, `/pause`, `/resume`) are vLLM's
    and not enginectl's (`enginectl serve` mounts its own on those paths: docs/http_routes.md).
    It serves the embedded tiny model with the flags `enginectl serve` passes it by default
    (server/flags.py DEFAULT_MODEL_FLAGS: float32, max-model-len 256, the KV-cache size the CPU
    build needs, ...) and under the same served model name."""
    from enginectl.server.default_model import SERVED_MODEL_NAME, ensure_default_model
    from enginectl.server.flags import DEFAULT_MODEL_FLAGS

    model, port = str(ensure_default_model()), free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        *DEFAULT_MODEL_FLAGS,
    ]
    env = base_env()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    srv = VllmServer(cmd, env, name="vllm")
    srv.serving = {"http_port": port, "model": model, "served_model_name": SERVED_MODEL_NAME}
    return srv


def baseline_server(variant: str) -> ServeProcess:
    """A gRPC server of bench.lib.servers (no vLLM) in its own process."""
    return ServeProcess([sys.executable, "-m", "bench.lib.servers", "--variant", variant], bench_env(), name=variant)


def rollout_driver(
    server: ServeProcess,
    streams: int,
    max_tokens: int,
    max_seconds: float,
    via: str = "http",
    ttft_samples: bool = False,
) -> Worker:
    """`python -m bench.lib.clients rollouts`: `streams` streaming requests looping on the server
    until told to stop (or `max_seconds`): /v1/completions on its HTTP API (`via="http"`) or
    Generate of vLLM's gRPC engine service on its control port (`via="grpc"`)."""
    args = ["--streams", str(streams), "--max-tokens", str(max_tokens), "--max-seconds", str(max_seconds)]
    args += ["--ttft-samples"] if ttft_samples else []
    if via == "grpc":
        return Worker(["rollouts", "--via", "grpc", "--grpc", server.grpc_target, *args])
    return Worker(["rollouts", "--http", f"127.0.0.1:{server.http_port}", "--model", server.served_model, *args])


HTTP_STARTUP_LINE = b"Application startup complete"  # uvicorn, logged just before it listens


def wait_http_ready(srv: ServeProcess, startup_line: threading.Event, timeout: float = 60.0) -> dict:
    """vLLM's HTTP API may not listen yet when enginectl logs `serving`: wait for uvicorn's
    startup line, then probe; a refused probe waits for more server output (bounded)."""
    t0 = time.monotonic()
    line_seen = startup_line.wait(timeout)
    deadline = time.monotonic() + timeout
    probes = 0
    while True:
        probes += 1
        try:
            http_get_status(srv.http_port, "/version")
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline or srv.proc is None or srv.proc.poll() is not None:
                raise RuntimeError(f"vLLM HTTP API never accepted connections:\n{srv.tail()}") from None
            srv.wait_output(0.05)
    return {"startup_line_seen": line_seen, "probes": probes, "after_serving_s": round(time.monotonic() - t0, 3)}


def http_get_status(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


class Worker:
    """A load-generating subprocess (`python -m bench.lib.clients ...`, or another `module`)
    speaking JSON lines."""

    def __init__(self, args: list[str], module: str = "bench.lib.clients") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=bench_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: deque[dict] = deque()
        self._cond = threading.Condition()
        self._eof = False
        self._stderr: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            with self._cond:
                self._lines.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip("\n"))

    def expect(self, event: str, timeout: float) -> dict:
        """The next JSON line with this `event` (a worker `error` line raises)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._lines:
                    msg = self._lines.popleft()
                    if msg.get("event") == "error":
                        raise RuntimeError(f"worker error: {msg}\n" + "\n".join(self._stderr))
                    if msg.get("event") == event:
                        return msg
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    self.kill()
                    raise RuntimeError(
                        f"worker gave no {event!r} ({'exited' if self._eof else 'timed out'}):\n"
                        + "\n".join(self._stderr)
                    )
                self._cond.wait(left)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 30.0) -> int:
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
