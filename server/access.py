"""Who may reach the control port, from `enginectl serve`'s flags: its bearer token, its TLS
config, the refusal to expose it beyond loopback with neither, and whether the port is free
before the engine's long start (docs/operations.md, "Security"). Read once at start by
server/flags.py `take_config` and server/serve.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket

from enginectl.server.config import TlsConfig

TOKEN_ENV = "ENGINECTL_TOKEN"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
        if not token:
            raise SystemExit(f"enginectl serve: {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def load_tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise SystemExit("enginectl serve: --tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise SystemExit("enginectl serve: --tls-cert and --tls-key go together")
    return TlsConfig(
        cert_chain=args.tls_cert.read_bytes(),
        private_key=args.tls_key.read_bytes(),
        client_ca=args.tls_client_ca.read_bytes() if args.tls_client_ca else None,
    )


def check_port_free(host: str, port: int) -> None:
    """Fail before the engine's long start if the gRPC port is already taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"enginectl serve: gRPC port {host}:{port} is not available: {exc}") from None


def security(args: argparse.Namespace) -> tuple[str | None, TlsConfig | None]:
    """The bearer token and TLS config the flags ask for. Refuses to expose gRPC beyond
    loopback with neither, unless --insecure."""
    token, tls = load_token(args), load_tls(args)
    if not _is_loopback(args.grpc_host) and token is None and tls is None and not args.insecure:
        raise SystemExit(
            f"enginectl serve: refusing to serve gRPC on non-loopback {args.grpc_host} with neither "
            f"a token (--token-file / ${TOKEN_ENV}) nor TLS (--tls-cert); pass --insecure to override"
        )
    return token, tls
