"""Shared records of the soak (bench/soak/run.py): its fixed names and bounds of time, the errors and
acknowledged writes every load loop reports into, and resource snapshots of the server's processes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psutil

from bench.lib.harness import ServeProcess
from enginectl.client import EnginectlError, WeightVersion

WORKER_ID = "soak"
SOURCES = ("disk", "tensors", "gloo")
# What vLLM's EngineCore stamps on outputs until a version is handed to it (its
# `_weight_version` starts as "default"): rollouts that ran before the first declaration carry
# it. The soak never declares it, so it is counted apart from versions nobody declared.
VLLM_PLACEHOLDER = "default"
UPDATE_TIMEOUT_S = 120.0  # bound of each update (the server's `timeout`, and our wait)
REQUEST_TIMEOUT_S = 120.0  # one rollout, one unary RPC
MIB = 1 << 20


class Errors:
    """Every failed call, by (where, code, reason); the first messages of each kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def add(self, where: str, code: str, reason: str = "", message: str = "") -> None:
        key = f"{where} {code}{' ' + reason if reason else ''}"
        with self._lock:
            self.counts[key] += 1
            self.examples.setdefault(key, message[:300])

    def rpc(self, where: str, err: EnginectlError) -> None:
        self.add(where, err.code.name, err.reason, err.message)

    def internal(self) -> int:
        """UNKNOWN / INTERNAL statuses and HTTP 5xx: a server fault, never an expected outcome."""
        return sum(
            n
            for k, n in self.counts.items()
            if k.split()[1] in ("UNKNOWN", "INTERNAL") or k.split()[1].startswith("HTTP_5")
        )

    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Write:
    """An acknowledged write of the version: what the server answered."""

    kind: str  # cas, decl, disk, tensors, gloo
    version: str
    revision: int


class Writes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[Write] = []

    def add(self, kind: str, version: str, revision: int) -> None:
        with self._lock:
            self.items.append(Write(kind, version, revision))

    def add_state(self, kind: str, state: WeightVersion) -> None:
        self.add(kind, state.version or "", state.revision)


@dataclass
class Snapshot:
    """Resources of the server process and its descendants at one moment."""

    label: str
    t_s: float
    during_update: bool
    processes: list[dict[str, Any]]
    updates: int = 0  # weight updates done when it was taken

    def total(self, key: str) -> int:
        return sum(int(p[key]) for p in self.processes)


def process_role(proc: psutil.Process, server_pid: int) -> str:
    if proc.pid == server_pid:
        return "serve"
    try:
        text = " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return "?"
    for role in ("EngineCore", "resource_tracker", "Worker"):
        if role in text:
            return role
    return proc.name()


def snapshot(server: ServeProcess, label: str, t0: float, during_update: bool = False) -> Snapshot:
    try:
        root = psutil.Process(server.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    rows = []
    for p in procs:
        try:
            with p.oneshot():
                rows.append(
                    {
                        "pid": p.pid,
                        "role": process_role(p, server.pid),
                        "rss_mib": round(p.memory_info().rss / MIB, 1),
                        "fds": p.num_fds(),
                        "threads": p.num_threads(),
                    }
                )
        except psutil.Error:
            continue
    return Snapshot(label, round(time.monotonic() - t0, 1), during_update, rows)
