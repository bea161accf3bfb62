"""Fixtures that start real `enginectl serve` subprocesses on the embedded tiny model.

One server for the whole session (`server`) keeps the suite fast, and one that may load
weights (`weights_server`, on the session's `checkpoints`); tests that need a fresh
incarnation or a particular flag start their own with `ServeProcess`. A module that needs
servers of its own defines its own `checkpoints` or `weights_server` fixture, which overrides
these for that module's tests only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, build_checkpoints, start_weights_server, stop_server


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


@pytest.fixture(scope="session")
def checkpoints(serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Checkpoints A and B under a fresh allowed root (support/weights.py)."""
    return build_checkpoints(serve_env, tmp_path_factory.mktemp("weights-root"))


@pytest.fixture(scope="session")
def weights_server(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[ServeProcess]:
    """One server for the weight tests of the session (starts with checkpoint A)."""
    srv = start_weights_server(serve_env, checkpoints)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def stubs(weights_server: ServeProcess) -> Stubs:
    return Stubs(weights_server)
