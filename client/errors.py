"""Errors of the enginectl API: stable reasons, and the exceptions the client raises.

Every error enginectl returns is a `google.rpc.Status` whose details hold an `ErrorInfo`
(domain `DOMAIN`, one of the reasons below) and, for bad fields, a `BadRequest`. The client
turns it into an `EnginectlError` subclass chosen by gRPC code, carrying the reason, so
callers branch on `err.reason`, never on message text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2

# Re-exported: part of the client's public names.
from enginectl.common.vocabulary import DOMAIN as DOMAIN
from enginectl.common.vocabulary import FieldViolation as FieldViolation
from enginectl.common.vocabulary import Reason as Reason


@dataclass
class EnginectlError(Exception):
    """An RPC failed. `reason` is the stable ErrorInfo reason ("" if the server sent none)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    field_violations: tuple[FieldViolation, ...] = ()

    def __str__(self) -> str:
        reason = f" {self.reason}" if self.reason else ""
        return f"{self.code.name}{reason}: {self.message}"


class InvalidArgumentError(EnginectlError):
    """INVALID_ARGUMENT: the request is wrong; nothing changed."""


class AbortedError(EnginectlError):
    """ABORTED: a concurrency conflict (stale etag, update in progress); re-read and retry."""

    @property
    def current_etag(self) -> str | None:
        """ETAG_MISMATCH: the resource's etag when the write was refused (None otherwise), so
        a compare-and-set can be retried without reading again."""
        return self.metadata.get("current_etag")


class NotFoundError(EnginectlError):
    """NOT_FOUND."""


class OutOfRangeError(EnginectlError):
    """OUT_OF_RANGE: e.g. a resume point no longer kept; re-sync from the current state."""


class FailedPreconditionError(EnginectlError):
    """FAILED_PRECONDITION: the server is not in a state to do this."""


class UnavailableError(EnginectlError):
    """UNAVAILABLE: the server or its engine is going away; retry elsewhere or later."""


class UnauthenticatedError(EnginectlError):
    """UNAUTHENTICATED: a mutating RPC without a valid bearer token."""


class DeadlineExceededError(EnginectlError):
    """DEADLINE_EXCEEDED."""


class UnimplementedError(EnginectlError):
    """UNIMPLEMENTED: this server does not offer the RPC (yet)."""


_BY_CODE: dict[grpc.StatusCode, type[EnginectlError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def error_class(code: grpc.StatusCode) -> type[EnginectlError]:
    """The exception class the client raises for a gRPC status code."""
    return _BY_CODE.get(code, EnginectlError)


def status_details(status: status_pb2.Status) -> tuple[str, dict[str, str], tuple[FieldViolation, ...]]:
    """Extract (reason, metadata, field violations) from a google.rpc.Status."""
    reason, meta, violations = "", {}, []  # type: tuple[str, dict[str, str], list[FieldViolation]]
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, meta = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
    return reason, meta, tuple(violations)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(status: status_pb2.Status) -> EnginectlError:
    """The EnginectlError a google.rpc.Status (e.g. a failed Operation's `error`) stands for."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    reason, meta, violations = status_details(status)
    return error_class(code)(
        code=code, message=status.message, reason=reason, metadata=meta, field_violations=violations
    )


def from_rpc_error(err: grpc.RpcError) -> EnginectlError:
    """Translate a grpc.RpcError (sync or aio) into an EnginectlError carrying its reason."""
    from grpc_status import rpc_status

    code: grpc.StatusCode = err.code()
    try:
        status = rpc_status.from_call(err)
    except ValueError:  # inconsistent status details: keep the plain code and message
        status = None
    if status is not None:
        return from_status(status)
    return error_class(code)(code=code, message=err.details() or "")
