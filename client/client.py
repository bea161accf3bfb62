"""Typed clients for the enginectl API: `AsyncClient` (asyncio) and `Client` (blocking,
the same methods run on a private event-loop thread; see _sync.py).

Channel options, bearer token, TLS, timeouts and retries live here, in one place; callers
get `WeightVersion` values and `EnginectlError` exceptions carrying the server's reason,
never raw stubs or protobuf. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypedDict, Unpack

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginectl.client._sync import LoopOwner, blocking, streaming
from enginectl.client.errors import from_rpc_error
from enginectl.client.types import IdentityAcks, RankIdentity, WeightVersion, WorkerIdentity
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 30.0

# Transparent retries of transport failures (UNAVAILABLE) for unary calls. Safe for
# SetWeightVersion because the client always sends a request_id (idempotent on the server).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "enginectl.weights.v1.WeightVersionService"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


class ChannelOptions(TypedDict, total=False):
    """The keyword arguments every client takes: the fields of ChannelConfig but `target`."""

    token: str | None
    tls: bool
    root_certificates: bytes | None
    client_certificate: bytes | None
    client_key: bytes | None
    timeout: float
    options: Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class ChannelConfig:
    """How to reach a server. `tls=True` uses the system roots unless `root_certificates`."""

    target: str = DEFAULT_TARGET
    token: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    client_certificate: bytes | None = None
    client_key: bytes | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    options: Sequence[tuple[str, Any]] = ()

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            *self.options,
        ]

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.client_key,
            certificate_chain=self.client_certificate,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def aio_channel(self) -> grpc.aio.Channel:
        creds, options = self.credentials(), self.channel_options()
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, creds, options=options)

    def channel(self) -> grpc.Channel:
        creds, options = self.credentials(), self.channel_options()
        if creds is None:
            return grpc.insecure_channel(self.target, options=options)
        return grpc.secure_channel(self.target, creds, options=options)


class Connection:
    """One server's channel, shared by a client and the helpers it holds: every unary call on
    it goes through `unary`, with the config's deadline and bearer token, and fails as an
    EnginectlError carrying the server's reason."""

    def __init__(self, config: ChannelConfig) -> None:
        self.config = config
        self.channel = config.aio_channel()

    async def unary(self, method: Callable[..., Any], request: Message, timeout: float | None) -> Any:
        """`method` (a stub's unary call) with `request`; `timeout` None: the config's."""
        try:
            return await method(request, timeout=timeout or self.config.timeout, metadata=self.config.metadata())
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None

    async def close(self) -> None:
        """Close the channel (calls in flight end with CANCELLED)."""
        await self.channel.close()


def _set_request(version: str, etag: str | None, request_id: str | None) -> wv_pb2.SetWeightVersionRequest:
    return wv_pb2.SetWeightVersionRequest(version=version, etag=etag or "", request_id=request_id or str(uuid.uuid4()))


def _rank_timeout(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def _ranks(ranks: Sequence[id_pb2.RankIdentity]) -> tuple[RankIdentity, ...]:
    return tuple(RankIdentity(r.dp_rank, r.worker_id, r.identity_generation) for r in ranks)


def _watch_request(since_revision: int | None, incarnation: str | None) -> wv_pb2.WatchWeightVersionRequest:
    request = wv_pb2.WatchWeightVersionRequest(incarnation=incarnation or "")
    if since_revision is not None:
        request.since_revision = since_revision
    return request


class AsyncClient:
    """asyncio client. Use as `async with AsyncClient("host:port") as c: ...`.

    `config` is how it reaches the server, `connection` the channel it made (on the loop
    it was created on), which the trainer, fleet and their helpers call through too.
    """

    def __init__(self, target: str = DEFAULT_TARGET, **config: Unpack[ChannelOptions]) -> None:
        self.config = ChannelConfig(target=target, **config)
        self.connection = Connection(self.config)
        self._versions = wv_grpc.WeightVersionServiceStub(self.connection.channel)
        self._identity = id_grpc.FpmIdentityServiceStub(self.connection.channel)
        self._health = health_pb2_grpc.HealthStub(self.connection.channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (calls in flight end with CANCELLED)."""
        await self.connection.close()

    async def serving(self, service: str = "", *, timeout: float | None = None) -> bool:
        """gRPC health (`grpc.health.v1.Health/Check`) of `service` ("" the whole server):
        SERVING, or not (quarantined after a partial update, draining, the engine dead)."""
        response = await self.connection.unary(
            self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout
        )
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def get_weight_version(self, *, timeout: float | None = None) -> WeightVersion:
        """The WeightVersion resource (no engine round trip on the server)."""
        response = await self.connection.unary(
            self._versions.GetWeightVersion, wv_pb2.GetWeightVersionRequest(), timeout
        )
        return WeightVersion.from_proto(response.weight_version)

    async def set_weight_version(
        self,
        version: str,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> WeightVersion:
        """Declare `version` for the weights in memory (declare-only; nothing is paused).

        With `etag`, applies only if it is still current (else AbortedError ETAG_MISMATCH,
        whose `current_etag` is the etag to retry with once the caller has decided to).
        A `request_id` (a UUID; one is generated when omitted) makes retries idempotent.
        """
        response = await self.connection.unary(
            self._versions.SetWeightVersion, _set_request(version, etag, request_id), timeout
        )
        return WeightVersion.from_proto(response.weight_version)

    async def watch_weight_version(
        self, *, since_revision: int | None = None, incarnation: str | None = None
    ) -> AsyncIterator[WeightVersion]:
        """Yield the current state (or every state after `since_revision`), then each change.

        Pass the `incarnation` that `since_revision` was read under (the WeightVersion's):
        if the server restarted since, the watch fails with OutOfRangeError
        INCARNATION_CHANGED instead of resuming from an unrelated revision; watch again
        without `since_revision` then.
        """
        call = self._versions.WatchWeightVersion(
            _watch_request(since_revision, incarnation), metadata=self.config.metadata()
        )
        try:
            async for response in call:
                yield WeightVersion.from_proto(response.weight_version)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    def _identity_deadline(self, rank_timeout: float | None, timeout: float | None) -> float:
        """The call's deadline: `timeout`, else long enough for the ranks' own `rank_timeout`."""
        if timeout is not None:
            return timeout
        return max(self.config.timeout, (rank_timeout or 0.0) + 5.0)

    async def get_worker_identity(
        self, *, rank_timeout: float | None = None, timeout: float | None = None
    ) -> WorkerIdentity:
        """Ask every rank's EngineCore for the identity it holds now (GetWorkerIdentity);
        `rank_timeout` bounds each rank's answer (server default 5 s, at most 300 s)."""
        request = id_pb2.GetWorkerIdentityRequest(timeout=_rank_timeout(rank_timeout))
        response = await self.connection.unary(
            self._identity.GetWorkerIdentity, request, self._identity_deadline(rank_timeout, timeout)
        )
        return WorkerIdentity(_ranks(response.ranks), response.consistent, response.await_worker_id)

    async def set_worker_identity(
        self, worker_id: str, *, rank_timeout: float | None = None, timeout: float | None = None
    ) -> IdentityAcks:
        """Set the worker id stamped on every rank's samples (SetWorkerIdentity); returns once
        every rank acked, within `rank_timeout` (server default 10 s, at most 300 s). Setting the
        id every rank already holds changes nothing (a safe retry). Raises IDENTITY_SYNC_FAILED
        with `failed_ranks`/`acked_ranks` in the error's metadata when a rank did not ack."""
        request = id_pb2.SetWorkerIdentityRequest(worker_id=worker_id, timeout=_rank_timeout(rank_timeout))
        response = await self.connection.unary(
            self._identity.SetWorkerIdentity, request, self._identity_deadline(rank_timeout, timeout)
        )
        return IdentityAcks(_ranks(response.ranks))


class Client(LoopOwner[AsyncClient]):
    """Blocking client with the methods of AsyncClient (run on a private event-loop thread).
    Use as a context manager, or call `close()`."""

    _core: AsyncClient

    def __init__(self, target: str = DEFAULT_TARGET, **config: Unpack[ChannelOptions]) -> None:
        super().__init__(f"enginectl-{type(self).__name__}", lambda: self._connect(target, config))
        self.config = self._core.config

    async def _connect(self, target: str, config: ChannelOptions) -> AsyncClient:
        """The async client this one fronts (made on the loop, where its channel lives)."""
        return AsyncClient(target, **config)

    serving = blocking(AsyncClient.serving)
    get_weight_version = blocking(AsyncClient.get_weight_version)
    set_weight_version = blocking(AsyncClient.set_weight_version)
    watch_weight_version = streaming(AsyncClient.watch_weight_version)
    get_worker_identity = blocking(AsyncClient.get_worker_identity)
    set_worker_identity = blocking(AsyncClient.set_worker_identity)
