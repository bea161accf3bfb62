"""`enginectl serve` as a subprocess, for tests: start, wait for readiness, stop, reap."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 60.0


@dataclass
class ServeProcess:
    """`enginectl serve` as a subprocess; ready once it logs its `serving` event."""

    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    exited: threading.Event = field(default_factory=threading.Event)
    serving: dict[str, object] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> ServeProcess:
        cmd = [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0", "--log-json", *self.args]
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "serving":
                    self.serving = event
                    self.ready.set()
        self.exited.set()
        self.ready.set()  # wake a waiter: the process ended

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServeProcess:
        if not self.ready.wait(timeout) or not self.serving:
            self.kill()
            pytest.fail(f"enginectl serve did not become ready:\n{self.tail()}")
        return self

    def events(self) -> list[dict]:
        """The JSON log events (enginectl's own lines) logged so far."""
        out = []
        for line in list(self.lines):
            if line.startswith('{"'):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def wait_for_event(self, match: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        """Block until a JSON log event satisfies `match` (or fail after `timeout`)."""
        found: list[dict] = []

        def seen() -> bool:
            found[:] = [e for e in self.events() if match(e)]
            return bool(found) or self.exited.is_set()

        with self._cond:
            self._cond.wait_for(seen, timeout)
        if not found:
            pytest.fail(f"no matching log event within {timeout}s:\n{self.tail()}")
        return found[0]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.serving['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.serving['http_port']}"

    @property
    def model(self) -> str:
        return str(self.serving["model"])

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def terminate(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        """SIGTERM, then wait for exit; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.exited.wait(timeout)
        return code

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for child in self.descendants():
            child.kill()
        self.proc.kill()
        self.proc.wait(30)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


