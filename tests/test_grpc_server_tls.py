"""ControlPlaneServer over TLS and mTLS, in-process (the ledger needs no engine for this)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from enginectl.client import AsyncClient, EnginectlError, UnavailableError
from enginectl.server.grpc_server import ControlPlaneServer, TlsConfig
from enginectl.server.weights.ledger import WeightVersionLedger


@dataclass(frozen=True)
class Pki:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _cert("enginectl test CA", ca_key, None, ca_key, ca=True)
    server = _cert("enginectl server", server_key, ca, ca_key, server=True)
    client = _cert("trainer", client_key, ca, ca_key)
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    return Pki(pem(ca), pem(server), _pem_key(server_key), pem(client), _pem_key(client_key))


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
