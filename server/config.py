"""What enginectl's flags of one `enginectl serve` say, as typed values.

Runs in the `enginectl serve` process. server/flags.py makes these from the command line
(checked); server/wiring.py and server/serve.py take them; ControlPlaneServer takes a
TlsConfig. Plain values: no server module is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    """Server TLS; with `client_ca` set, clients must present a certificate it signed (mTLS)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class GrpcConfig:
    """The control plane's port and who may call it."""

    host: str
    port: int  # 0: a free one
    token: str | None
    tls: TlsConfig | None
    log_reads: bool


@dataclass(frozen=True)
class FpmRelayConfig:
    """The FPM relay's bounds (--fpm-ring-size, --fpm-subscriber-queue)."""

    ring_size: int
    queue_limit: int


@dataclass(frozen=True)
class IdentityConfig:
    """The worker identity at start and its policy (--worker-id, --await-worker-id, ...)."""

    worker_id: str  # every rank's identity from the start ("" for none)
    await_worker_id: bool
    exit_on_failure: bool  # a failed sync with await_worker_id shuts the server down
    heartbeat_interval_s: float


@dataclass(frozen=True)
class UpdateConfig:
    """Where updates may load from and what staging may hold (--allow-weights-from, ...)."""

    allow_weights_from: tuple[Path, ...]
    max_staged_bytes: int | None  # None: the served model's size
    staged_ttl: float
    load_check: str = "full"  # --load-check: "full" or "finite" (docs/weights.md)

    def allowed_roots(self, model: str) -> list[Path]:
        """Where UpdateWeightsFromDisk may load from: the flags' directories, or the one
        holding the served model."""
        roots = [Path(p).resolve() for p in self.allow_weights_from]
        if not roots and Path(model).is_dir():
            roots = [Path(model).resolve().parent]
        return roots


@dataclass(frozen=True)
class RolloutConfig:
    """vLLM's gRPC engine service on the control port (--no-grpc-rollouts, ...)."""

    enabled: bool
    token_guards: bool  # --token-guards-rollouts
    log_requests: bool  # vLLM's --enable-log-requests


@dataclass(frozen=True)
class GatewayConfig:
    """The SMG gateway this server registers with (--gateway, --gateway-token-file, ...)."""

    url: str  # SMG's HTTP address, e.g. http://10.0.0.5:30000
    token: str | None  # sent as `Authorization: Bearer` on /workers calls (SMG's control-plane key)
    advertise_host: str  # the host in the grpc:// and http:// URLs SMG is given


@dataclass(frozen=True)
class MultinodeConfig:
    """An engine whose ranks may run on other nodes (DESIGN §13, docs/multinode.md)."""

    # Where the relay and every update's channels also listen on TCP for ranks on other hosts
    # (--channel-address, default --data-parallel-address); None: every rank is this head's
    # (--data-parallel-size-local is the whole --data-parallel-size), nothing listens on TCP.
    channel_address: str | None = None
    # --liveness-timeout: a remote rank silent this long is a dead engine; a headless node's
    # head, too.
    liveness_timeout_s: float = 10.0


@dataclass(frozen=True)
class ServeConfig:
    """What enginectl's flags of one start say, checked."""

    grpc: GrpcConfig
    fpm: FpmRelayConfig
    identity: IdentityConfig
    updates: UpdateConfig
    rollouts: RolloutConfig
    log_json: bool
    gateway: GatewayConfig | None = None  # None: no --gateway
    allow_vllm_dev_routes: bool = False  # --allow-vllm-dev-routes (docs/http_routes.md)
    # vLLM's --weight-transfer-config backend (docs/weights.md); None: no transfer engine
    weight_transfer_backend: str | None = None
    multinode: MultinodeConfig = MultinodeConfig()
