"""The SMG gateway (`smg launch`, the Rust binary of the `smg` package) as a subprocess of the bench.

Runs in the `python -m bench` process. The bench imports nothing from tests/ (bench/lib/harness.py
is the one module shared, imported by the tests), so this is the bench's own few lines of
tests/support/smg.py: the same command (docs/rollouts.md, "Behind the SMG gateway"), readiness on
`GET /health` answering 200, the log in a file for error reports, SIGTERM then SIGKILL, reaped.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMG = Path(sys.executable).parent / "smg"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.02


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def smg_command(port: int, health_check_interval_s: int = 1) -> list[str]:
    """`smg launch` on 127.0.0.1:`port` with the RL plane and worker registration (POST /workers)
    on; its metrics server on a free loopback port (its default, 0.0.0.0:29000, is one per host)."""
    return [
        str(SMG),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-rl",
        "--enable-igw",
        "--health-check-interval-secs",
        str(health_check_interval_s),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]


class SmgProcess:
    """One `smg launch` subprocess on a free port: `start()`, `url`, `rl_workers()`, `stop()`."""

    def __init__(self, health_check_interval_s: int = 1) -> None:
        self.port = free_port()
        self.cmd = smg_command(self.port, health_check_interval_s)
        self._log_dir = tempfile.TemporaryDirectory(prefix="bench-smg-")
        self.log_path = Path(self._log_dir.name) / "smg.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self, tail: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""

    def start(self, timeout: float = READY_TIMEOUT_S) -> SmgProcess:
        """Start SMG; return once GET /health answers 200 (RuntimeError with its log otherwise)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"smg did not answer /health within {timeout:.0f}s:\n{self.log()}")
            threading.Event().wait(POLL_S)  # a subprocess opening its port: nothing to wait on but polling

    def rl_workers(self) -> list[dict[str, Any]]:
        """GET /v1/rl/workers: the RL plane's rows (url, health, weight_version, labels)."""
        with urllib.request.urlopen(self.url + "/v1/rl/workers", timeout=5.0) as r:
            return list(json.loads(r.read())["workers"])

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float) -> list[dict[str, Any]]:
        """Poll /v1/rl/workers until `predicate(rows)` holds; those rows (RuntimeError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.rl_workers()
            if predicate(rows):
                return rows
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg: not within {timeout}s; /v1/rl/workers is {json.dumps(rows)[:1500]}")
            threading.Event().wait(POLL_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, object]:
        """SIGTERM, wait, SIGKILL after `timeout`; reaped. How it went (idempotent)."""
        if self.proc is None:
            return {"name": "smg", "started": False}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log_dir.cleanup()
        return {"name": "smg", "exit_code": self.proc.returncode}
