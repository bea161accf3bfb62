"""Fixtures of every test, unit and end to end: the servers' environment and a throwaway PKI.

The fixtures that start `enginectl serve` are in tests/e2e/conftest.py, so a unit test can not
ask for a server. The helpers behind all fixtures are in tests/support/ (imported as
`support.*`: pytest puts tests/, this file's folder, on sys.path).
"""

from __future__ import annotations

import pytest
from support.pki import Pki, make_pki
from support.serving import base_env


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for servers: offline, no usage stats, no token, a per-session model cache."""
    env = base_env()
    env["ENGINECTL_CACHE_DIR"] = str(tmp_path_factory.mktemp("enginectl-cache"))
    return env


@pytest.fixture(scope="module")
def pki() -> Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, per module."""
    return make_pki()
