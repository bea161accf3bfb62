"""Subprocesses of the benchmark: servers that announce readiness with a JSON `serving` line.

Runs in the `python -m bench` process. A server is ready once it prints a JSON line whose
`event` is `serving` (enginectl's structlog line, or bench.servers' own); no sleeps. After
that its output is only drained (enginectl logs one line per RPC) and its tail kept for
error reports. `stop()` sends SIGTERM, waits, and checks that no descendant survived.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 60.0
TAIL_LINES = 80


class ServerProcess:
    """A server subprocess: start, wait for its `serving` line, drain its output, stop, reap."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.cmd = cmd
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.serving: dict[str, object] = {}
        self.lines_seen = 0
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._ready = threading.Event()
        self._exited = threading.Event()
        self._output = threading.Condition()  # notified on every chunk of output
        self._watch: dict[bytes, threading.Event] = {}
        self._children: list[psutil.Process] = []

    # -- lifecycle -----------------------------------------------------------------------
    def watch(self, pattern: bytes) -> threading.Event:
        """An event set once `pattern` appears in the output (register before start())."""
        return self._watch.setdefault(pattern, threading.Event())

    def _check(self, data: bytes) -> None:
        for pattern, event in self._watch.items():
            if not event.is_set() and pattern in data:
                event.set()
        with self._output:
            self._output.notify_all()

    def wait_output(self, timeout: float) -> None:
        """Block until the server writes more output (or `timeout`)."""
        with self._output:
            self._output.wait(timeout)

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=False,
        )
        threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        # Until ready: parse lines. Afterwards: read in large chunks, count lines, keep a tail.
        for raw in out:
            self._note(raw)
            self._check(raw)
            if self._ready.is_set():
                break
        partial = b""
        while True:
            chunk = out.read1(1 << 16) if hasattr(out, "read1") else out.read(1 << 16)
            if not chunk:
                break
            self.lines_seen += chunk.count(b"\n")
            self._check(partial[-200:] + chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines[-TAIL_LINES:]:
                self._tail.append(line.decode(errors="replace"))
        self._exited.set()
        self._ready.set()  # wake a waiter: the process ended
        self._check(b"")

    def _note(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\n")
        self.lines_seen += 1
        self._tail.append(line)
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                return
            if event.get("event") == "serving":
                self.serving = event
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        if not self._ready.wait(timeout) or not self.serving:
            tail = self.tail()
            self.kill()
            why = "exited" if self._exited.is_set() else f"timed out after {timeout:.0f}s"
            raise RuntimeError(f"{self.name} did not become ready ({why}; exit code "
                               f"{self.proc.returncode if self.proc else None}):\n{tail}")
        assert self.proc is not None
        try:
            self._children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            self._children = []
        return self

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self._tail)[-n:])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.serving['grpc_port']}"

    @property
    def http_port(self) -> int:
        return int(self.serving["http_port"])  # type: ignore[arg-type]

    def cpu_seconds(self) -> float:
        """User+system CPU time of the server's main process (all its threads)."""
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> dict[str, object]:
        """SIGTERM, wait for exit, check no descendant is left (killing any). Idempotent."""
        if self.proc is None:
            return {"name": self.name, "started": False}
        try:
            self._children = list({p.pid: p for p in (
                *self._children, *psutil.Process(self.proc.pid).children(recursive=True))}.values())
        except psutil.NoSuchProcess:
            pass
        t0 = time.monotonic()
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                code = self.proc.returncode
        left = _alive(self._children)
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return {"name": self.name, "exit_code": code, "stop_s": round(time.monotonic() - t0, 2),
                "children": len(self._children), "children_left": [p.pid for p in left]}

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
        except psutil.NoSuchProcess:
            pass
        self.proc.kill()
        self.proc.wait(30)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    env.pop("ENGINECTL_TOKEN", None)
    return env


def enginectl_server(extra_args: list[str] = ()) -> ServerProcess:  # type: ignore[assignment]
    """`enginectl serve` on the embedded tiny model; VLLM_SERVER_DEV_MODE=1 exposes vLLM's
    RL routes (/weight_info) on its HTTP API."""
    env = base_env()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    cmd = [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0", "--log-json",
           *extra_args]
    return ServerProcess("enginectl", cmd, env)


def baseline_server(variant: str) -> ServerProcess:
    """A gRPC server of bench.servers (no vLLM) in its own process."""
    cmd = [sys.executable, "-m", "bench.servers", "--variant", variant]
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    return ServerProcess(variant, cmd, env)


class Worker:
    """A load-generating subprocess (`python -m bench.clients ...`, or another `module`)
    speaking JSON lines."""

    def __init__(self, args: list[str], module: str = "bench.clients") -> None:
        env = base_env()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                          env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
                        + "\n".join(self._stderr))
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
