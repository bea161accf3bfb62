"""The SMG gateway (`smg launch`, the Rust binary of the `smg` package) as a subprocess, for tests.

Runs in the test process: starts `.venv/bin/smg launch` (found next to sys.executable) on a
free port, waits until it answers GET /health, keeps its log in a file for failure messages,
reads its worker lists over HTTP, and stops and reaps it (SIGKILL after a bound). The RL
plane (--enable-rl) is always on; --enable-igw (POST /workers) by default.

    with SmgGateway().start() as smg:
        rows = smg.wait_for(lambda ws: any(w["url"] == url for w in ws), timeout=10)
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

SMG = Path(sys.executable).parent / "smg"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.02


class SmgError(RuntimeError):
    """SMG did not start, or a wait ran out; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SmgGateway:
    """`smg launch --host HOST --port PORT --enable-rl [--enable-igw] ...` as a subprocess.

    `port`: None picks a free one. `worker_urls`: workers SMG starts with. `control_plane_token`:
    SMG then requires `Authorization: Bearer TOKEN` on its control plane (/workers), and
    `workers()` sends it. `api_key`: SMG's --api-key. `extra_args` go to `smg launch` as given.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        igw: bool = True,
        worker_urls: Sequence[str] = (),
        health_check_interval_s: int = 1,
        control_plane_token: str | None = None,
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host  # where it listens (another address than loopback for workers on other nodes)
        self.port = port or free_port(host)
        self.control_plane_token = control_plane_token
        self._log_dir = tempfile.TemporaryDirectory(prefix="smg-")
        self.log_path = Path(self._log_dir.name) / "smg.log"
        self.cmd = [
            str(SMG),
            "launch",
            "--host",
            host,
            "--port",
            str(self.port),
            # SMG's metrics server binds 0.0.0.0:29000 by default: one gateway per machine.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--enable-rl",
            "--health-check-interval-secs",
            str(health_check_interval_s),
            *(["--enable-igw"] if igw else []),
            *(["--worker-urls", *worker_urls] if worker_urls else []),
            *(["--control-plane-api-keys", f"tests:tests:admin:{control_plane_token}"] if control_plane_token else []),
            *(["--api-key", api_key] if api_key else []),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """SMG's HTTP address, e.g. http://127.0.0.1:40123."""
        return f"http://{self.host}:{self.port}"

    def log(self, tail: int = 60) -> str:
        """The last `tail` lines SMG logged."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-tail:])

    def _fail(self, message: str) -> SmgError:
        return SmgError(f"{message}\n--- smg log ({self.cmd[3:]}) ---\n{self.log()}")

    def start(self, timeout: float = READY_TIMEOUT_S) -> SmgGateway:
        """Start SMG and return once GET /health answers 200 (SmgError if it exits or the
        deadline passes; it is killed and reaped then)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise self._fail(f"smg exited with {self.proc.returncode} before answering /health")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self._fail(f"smg did not answer /health within {timeout:.0f}s")
            threading.Event().wait(POLL_S)  # a subprocess becoming ready: nothing to wait on but its port

    def get(self, path: str) -> Any:
        """GET `path` (JSON), with the control-plane token when there is one."""
        headers = {"authorization": f"Bearer {self.control_plane_token}"} if self.control_plane_token else {}
        request = urllib.request.Request(self.url + path, headers=headers)
        with urllib.request.urlopen(request, timeout=5.0) as r:
            return json.loads(r.read())

    def workers(self) -> list[dict[str, Any]]:
        """GET /workers: every worker SMG holds."""
        return list(self.get("/workers")["workers"])

    def rl_workers(self) -> list[dict[str, Any]]:
        """GET /v1/rl/workers: the RL plane's view (control_url, health, weight_version, labels)."""
        return list(self.get("/v1/rl/workers")["workers"])

    def wait_for(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Poll /v1/rl/workers until `predicate(rows)` holds; returns those rows (SmgError
        with the last rows and SMG's log when `timeout` passes)."""
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while True:
            rows = self.rl_workers()
            if predicate(rows):
                return rows
            if time.monotonic() > deadline:
                raise self._fail(f"not within {timeout}s; /v1/rl/workers is {json.dumps(rows)[:2000]}")
            threading.Event().wait(POLL_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; reaps it. Returns its exit code
        (None if it never started). Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def __enter__(self) -> SmgGateway:
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()
        self._log_dir.cleanup()
