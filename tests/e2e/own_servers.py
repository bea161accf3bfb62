"""Fixtures a test module makes its own: checkpoints and a weights server apart from the
session's (tests/e2e/conftest.py), and a TrainerClient on whichever `weights_server` the module
sees. Each function returns a fixture; the module binds it to the name its tests ask for:

    checkpoints = own_checkpoints()
    weights_server = own_weights_server()
    client = trainer_client()

A fixture defined in a module overrides the conftest one of that name for that module's tests
only, so one module's server is never another's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.serving import ServeProcess
from support.weights import Checkpoints, build_checkpoints, start_weights_server, stop_server

from enginectl.client import TrainerClient


def own_checkpoints() -> Any:
    """The module's `checkpoints` fixture."""

    @pytest.fixture(scope="session")
    def checkpoints(serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
        """This module's own checkpoints A and B, not the session's (tests/e2e/conftest.py); session
        scope, as the session's, so they last until the session ends."""
        return build_checkpoints(serve_env, tmp_path_factory.mktemp("weights-root"))

    return checkpoints


def own_weights_server() -> Any:
    """The module's `weights_server` fixture, on the `checkpoints` the module sees."""

    @pytest.fixture(scope="session")
    def weights_server(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[ServeProcess]:
        """This module's own server on its own checkpoints, not the session's (tests/e2e/conftest.py);
        session scope, as the session's, so it runs until the session ends."""
        srv = start_weights_server(serve_env, checkpoints)
        yield srv
        stop_server(srv)

    return weights_server


def trainer_client() -> Any:
    """The module's `client` fixture: one TrainerClient on `weights_server` for the module."""

    @pytest.fixture(scope="module")
    def client(weights_server: ServeProcess) -> Iterator[TrainerClient]:
        with TrainerClient(weights_server.grpc_target, timeout=120.0) as c:
            yield c

    return client
