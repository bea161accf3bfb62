"""Shared fixtures: real `enginectl serve` subprocesses on the embedded tiny model.

One server for the whole session (`server`) keeps the suite fast; tests that need a fresh
incarnation or a particular flag start their own with `ServeProcess`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.serving import ServeProcess, base_env

# Registered here, once for the session: a module that imports these fixtures itself gets
# instances of its own (pytest scopes an imported fixture to the module that imports it).
from support.weights import checkpoints, weights_server  # noqa: F401


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for servers: offline, no usage stats, no token, a per-session model cache."""
    env = base_env()
    env["ENGINECTL_CACHE_DIR"] = str(tmp_path_factory.mktemp("enginectl-cache"))
    return env


@pytest.fixture(scope="session")
def server(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    """The session's shared server: no token; vLLM's --enable-scale-out passes through so
    /inference/v1/generate reports RequestOutput.weight_versions."""
    srv = ServeProcess(["--enable-scale-out"], serve_env).start().wait_ready()
    yield srv
    try:
        srv.terminate()
    finally:
        srv.kill()
