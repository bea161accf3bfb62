"""ControlPlaneServer over TLS and mTLS, in-process (the ledger needs no engine for this)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.pki import Pki

from enginectl.client import AsyncClient, EnginectlError, UnavailableError
from enginectl.server.grpc_server import ControlPlaneServer, TlsConfig
from enginectl.server.weights.version.ledger import WeightVersionLedger


async def _serve(tls: TlsConfig) -> tuple[ControlPlaneServer, str]:
    plane = ControlPlaneServer(WeightVersionLedger(), tls=tls)
    port = await plane.start("127.0.0.1", 0)
    await plane.set_serving(True)
    return plane, f"127.0.0.1:{port}"


@pytest.fixture
async def tls_server(pki: Pki) -> AsyncIterator[str]:
    plane, target = await _serve(TlsConfig(pki.server_cert, pki.server_key))
    yield target
    await plane.stop(0)


@pytest.fixture
async def mtls_server(pki: Pki) -> AsyncIterator[str]:
    plane, target = await _serve(TlsConfig(pki.server_cert, pki.server_key, client_ca=pki.ca))
    yield target
    await plane.stop(0)


async def test_tls_client_with_the_ca_works_plaintext_does_not(tls_server: str, pki: Pki) -> None:
    async with AsyncClient(tls_server, tls=True, root_certificates=pki.ca, timeout=10) as c:
        state = await c.set_weight_version("over-tls")
        assert (await c.get_weight_version()) == state
    async with AsyncClient(tls_server, timeout=5) as plain:
        with pytest.raises(UnavailableError):
            await plain.get_weight_version()


async def test_mtls_requires_a_client_certificate(mtls_server: str, pki: Pki) -> None:
    async with AsyncClient(mtls_server, tls=True, root_certificates=pki.ca, timeout=5) as anonymous:
        with pytest.raises(EnginectlError):
            await anonymous.get_weight_version()
    async with AsyncClient(
        mtls_server,
        tls=True,
        root_certificates=pki.ca,
        client_certificate=pki.client_cert,
        client_key=pki.client_key,
        timeout=10,
    ) as c:
        assert (await c.get_weight_version()).declared is False
