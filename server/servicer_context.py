"""What a servicer reads of its call (`ServicerContext`), and the one stand-in for a call that
grpc.aio's server does not run (`LocalContext`).

Runs in the `enginectl serve` process. The servicers type their `context` with
`ServicerContext`: grpc.aio's context is one, and so is `LocalContext`, which serves twice:
for a call made in process (server/local_endpoint.py, on the control loop) and for a call of
vLLM's servicer relayed to the engine's loop (server/rollouts.py: a copy of the gRPC call's
metadata and deadline, taken on the control loop). Either way `abort` raises CallAborted
with the google.rpc.Status a gRPC client would have received, and a status set with
`set_code`/`set_details` is kept for `apply`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

import grpc
from google.rpc import status_pb2

from enginectl.server.errors import CallAborted

# The trailer that carries a google.rpc.Status (grpc_status.rpc_status puts it there).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ServicerContext(Protocol):
    """The part of grpc.aio.ServicerContext enginectl's servicers and vLLM's use."""

    def invocation_metadata(self) -> Sequence[tuple[str, Any]] | None: ...

    def peer(self) -> str: ...

    def time_remaining(self) -> float | None: ...

    def code(self) -> grpc.StatusCode | None: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...

    def set_trailing_metadata(self, metadata: Any) -> None: ...

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn: ...


def caller_of(context: ServicerContext) -> str:
    """Who made a call, for the logs and the records that name who staged or took over what
    (docs/weights.md, "A trainer that restarts"): its peer and its user agent. Not a proof of
    anything (the token is): a name for a person reading."""
    agent = next((str(v) for k, v in context.invocation_metadata() or () if k == "user-agent"), "")
    peer = context.peer() or "unknown"
    return f"{peer} ({agent})" if agent else peer


def status_code(status: status_pb2.Status) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Status (UNKNOWN for a number gRPC does not know)."""
    return next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)


class LocalContext:
    """The context of a call run outside grpc.aio's server: its metadata, peer and deadline;
    `abort` raises CallAborted with the status."""

    def __init__(self, metadata: Sequence[tuple[str, Any]], timeout: float | None, *, peer: str = "local") -> None:
        self._metadata = tuple(metadata)
        self._peer = peer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self._details = ""

    @classmethod
    def copy_of(cls, context: ServicerContext) -> LocalContext:
        """What another loop may read of `context`: its metadata, peer and deadline, now."""
        return cls(tuple(context.invocation_metadata() or ()), context.time_remaining(), peer=context.peer())

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass  # only Generate sets trailers, on the relayed call's own context

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        self._code = code
        for key, value in trailing_metadata or ():
            if key == STATUS_DETAILS_KEY:
                raise CallAborted(status_pb2.Status.FromString(value))
        raise CallAborted(status_pb2.Status(code=code.value[0], message=details))

    def apply(self, context: ServicerContext) -> None:
        """Hand a status set with set_code/set_details on to the call this one copies."""
        if self._code is not None:
            context.set_code(self._code)
            context.set_details(self._details)
