"""`enginectl serve` as a subprocess, for tests: bench/lib/harness.py's ServeProcess, keeping every
output line (for `events()` and `wait_for_event()`) and failing the test where it would raise.

Imported as `bench.lib.harness`: pytest runs from the repository root (`make test`,
`.venv/bin/python -m pytest`), which puts the root on sys.path.
"""

from __future__ import annotations

import subprocess
from typing import NoReturn

import pytest

from bench.lib import harness
from bench.lib.harness import BIN, EXIT_TIMEOUT_S, READY_TIMEOUT_S, alive, base_env

__all__ = ["BIN", "EXIT_TIMEOUT_S", "READY_TIMEOUT_S", "ServeProcess", "alive", "base_env", "enginectl_cli"]


class ServeProcess(harness.ServeProcess):
    """`enginectl serve --grpc-port 0 --http-port 0 --log-json ARGS`; ready once it logs its
    `serving` event."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(harness.serve_command(args), env, keep_lines=True)

    def fail(self, message: str) -> NoReturn:
        pytest.fail(message)


def enginectl_cli(*words: str, token: str | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`enginectl WORDS` as a script runs it (stdout not a terminal: JSON), with `token` as
    $ENGINECTL_TOKEN; stdout and stderr as text."""
    env = base_env() if token is None else {**base_env(), "ENGINECTL_TOKEN": token}
    return subprocess.run(
        [str(BIN / "enginectl"), *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
