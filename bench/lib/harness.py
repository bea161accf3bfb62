"""A server as a subprocess, for the tests and the benchmark: start, wait for its JSON `serving`
line, drain its output, stop, reap, and check that no descendant survived.

`enginectl serve --log-json` (or a bench.lib.servers baseline) is ready once it prints a JSON line
whose `event` is `serving`; nobody sleeps. Its output is drained by a thread: until ready line
by line, then in large chunks (enginectl logs one line per RPC, and a slow reader would stall the
server on a full pipe), counting lines and keeping a tail for error reports. With `keep_lines`
(the tests) every line is kept too, so that `events()` and `wait_for_event()` can read enginectl's
own JSON log. Used from tests/support/serving.py (which fails the test instead of raising) and bench/.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import psutil

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 60.0
TAIL_LINES = 80
CHUNK_BYTES = 1 << 16


class ServeError(RuntimeError):
    """A server did not become ready, or did not log what was waited for."""


def serve_command(args: Sequence[str] = ()) -> list[str]:
    """`enginectl serve` on free ports with JSON logs (the `serving` line names the ports)."""
    return [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0", "--log-json", *args]


def base_env() -> dict[str, str]:
    """This environment, offline, without usage stats or a token, unbuffered."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    env.pop("ENGINECTL_TOKEN", None)
    return env


def alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _split(data: bytes) -> list[str]:
    """Decoded lines of complete output; a lone carriage return (a progress bar) ends a line
    too, as in a text-mode pipe."""
    text = data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return text.split("\n")


class ServeProcess:
    """A server subprocess that announces readiness with a JSON `serving` line."""

    def __init__(
        self, cmd: Sequence[str], env: dict[str, str], *, name: str = "enginectl", keep_lines: bool = False
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.env = env
        self.keep_lines = keep_lines
        self.proc: subprocess.Popen[bytes] | None = None
        self.serving: dict[str, Any] = {}
        self.lines: list[str] = []  # every line, with keep_lines
        self.lines_seen = 0
        self.ready = threading.Event()  # set on `serving`, or when the output ends
        self.exited = threading.Event()  # set when the output ends (the process closed it)
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._output = threading.Condition()  # notified on every chunk of output
        self._watch: dict[bytes, threading.Event] = {}
        self._children: list[psutil.Process] = []

    def fail(self, message: str) -> NoReturn:
        """How a failed wait ends; tests/support/serving.py fails the test instead."""
        raise ServeError(message)

    # -- output -------------------------------------------------------------------------------
    def watch(self, pattern: bytes) -> threading.Event:
        """An event set once `pattern` appears in the output (register before start())."""
        return self._watch.setdefault(pattern, threading.Event())

    def start(self) -> ServeProcess:
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and isinstance(self.proc.stdout, io.BufferedReader)
        out = self.proc.stdout
        partial = b""
        while chunk := out.read1(CHUNK_BYTES):
            self._check(partial[-200:] + chunk)
            complete, newline, partial = (partial + chunk).rpartition(b"\n")
            if newline:
                self._lines(complete, chunk.count(b"\n"))
            with self._output:
                self._output.notify_all()
        if partial:
            self._lines(partial, 1)
        self.exited.set()
        self.ready.set()  # wake a waiter: the process ended
        self._check(b"")
        with self._output:
            self._output.notify_all()

    def _lines(self, data: bytes, count: int) -> None:
        """Take complete lines: count them, keep a tail (and all of them with keep_lines), and
        look for the `serving` line until it came."""
        self.lines_seen += count
        if not self.keep_lines and self.ready.is_set():  # a log line per RPC: decode only the tail
            data = b"\n".join(data.rsplit(b"\n", TAIL_LINES)[-TAIL_LINES:])
        lines = _split(data)
        self._tail.extend(lines[-TAIL_LINES:])
        if self.keep_lines:
            with self._output:
                self.lines.extend(lines)
        if not self.ready.is_set():
            for line in lines:
                if line.startswith("{") and self._note_serving(line):
                    break

    def _note_serving(self, line: str) -> bool:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(event, dict) or event.get("event") != "serving":
            return False
        self.serving = event
        self.ready.set()
        return True

    def _check(self, data: bytes) -> None:
        for pattern, event in self._watch.items():
            if not event.is_set() and pattern in data:
                event.set()

    def wait_output(self, timeout: float) -> None:
        """Block until the server writes more output (or `timeout`)."""
        with self._output:
            self._output.wait(timeout)

    def tail(self, n: int = 60) -> str:
        return "\n".join(list(self._tail)[-n:])

    def events(self) -> list[dict[str, Any]]:
        """The JSON log events (enginectl's own lines) logged so far (needs keep_lines)."""
        assert self.keep_lines, "events() reads the lines kept with keep_lines=True"
        out = []
        with self._output:
            lines = list(self.lines)
        for line in lines:
            if line.startswith('{"'):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def wait_for_event(self, match: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        """Block until a JSON log event satisfies `match` (or fail after `timeout`)."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.events() if match(e)]
            return bool(found) or self.exited.is_set()

        with self._output:
            self._output.wait_for(seen, timeout)
        if not found:
            self.fail(f"no matching log event within {timeout}s:\n{self.tail()}")
        return found[0]

    # -- lifecycle ----------------------------------------------------------------------------
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServeProcess:
        """Wait for the `serving` line; kill the server and fail if it exits or times out."""
        if not self.ready.wait(timeout) or not self.serving:
            tail = self.tail()
            self.kill()
            why = "exited" if self.exited.is_set() else f"timed out after {timeout:.0f}s"
            self.fail(
                f"{self.name} did not become ready ({why}; exit code "
                f"{self.proc.returncode if self.proc else None}):\n{tail}"
            )
        self._children = self.descendants()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.serving['grpc_port']}"

    @property
    def http_port(self) -> int:
        return int(self.serving["http_port"])

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def model(self) -> str:
        """The served model's path."""
        return str(self.serving["model"])

    @property
    def served_model(self) -> str:
        """What an HTTP request names as its "model" (vLLM's --served-model-name)."""
        return str(self.serving.get("served_model_name") or self.serving["model"])

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> float:
        """User+system CPU time of the server's main process (all its threads)."""
        t = psutil.Process(self.pid).cpu_times()
        return float(t.user + t.system)

    def _sigterm(self, timeout: float) -> int:
        """SIGTERM (unless it already exited), then wait; raises TimeoutExpired."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def terminate(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        """SIGTERM, wait for exit and for the rest of its output; returns the exit code."""
        code = self._sigterm(timeout)
        self.exited.wait(timeout)
        return code

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> dict[str, object]:
        """SIGTERM, wait for exit (SIGKILL after `timeout`), kill any descendant left; returns
        how it went. Idempotent."""
        if self.proc is None:
            return {"name": self.name, "started": False}
        self._children = list({p.pid: p for p in (*self._children, *self.descendants())}.values())
        t0 = time.monotonic()
        try:
            code: int | None = self._sigterm(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        left = alive(self._children)
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return {
            "name": self.name,
            "exit_code": code,
            "stop_s": round(time.monotonic() - t0, 2),
            "children": len(self._children),
            "children_left": [p.pid for p in left],
        }

    def kill(self) -> None:
        """SIGKILL its descendants and it, and reap it (no-op once it exited)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for child in self.descendants():
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.kill()
        self.proc.wait(30)
