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

DOMAIN = "enginectl.dev"


class Reason:
    """Stable `ErrorInfo.reason` strings. Values never change once released."""

    # WeightVersionService
    VERSION_REQUIRED = "VERSION_REQUIRED"
    VERSION_TOO_LONG = "VERSION_TOO_LONG"
    VERSION_INVALID = "VERSION_INVALID"  # a control character (as WORKER_ID_INVALID)
    ETAG_MISMATCH = "ETAG_MISMATCH"
    REQUEST_ID_INVALID = "REQUEST_ID_INVALID"
    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"
    REVISION_COMPACTED = "REVISION_COMPACTED"
    REVISION_IN_FUTURE = "REVISION_IN_FUTURE"
    # Weight updates (DESIGN §5, §7)
    UPDATE_IN_PROGRESS = "UPDATE_IN_PROGRESS"
    PATH_INVALID = "PATH_INVALID"
    PATH_NOT_FOUND = "PATH_NOT_FOUND"
    TOO_MANY_TENSORS = "TOO_MANY_TENSORS"
    TENSOR_SPEC_INVALID = "TENSOR_SPEC_INVALID"
    PAUSE_MODE_INVALID = "PAUSE_MODE_INVALID"
    PAUSE_TIMEOUT = "PAUSE_TIMEOUT"
    UPDATE_TIMEOUT = "UPDATE_TIMEOUT"
    UPDATE_CANCELLED = "UPDATE_CANCELLED"
    LOAD_FAILED = "LOAD_FAILED"
    STREAM_BROKEN = "STREAM_BROKEN"
    HEADER_REQUIRED = "HEADER_REQUIRED"
    CHUNK_TOO_LARGE = "CHUNK_TOO_LARGE"
    CHUNK_OUT_OF_ORDER = "CHUNK_OUT_OF_ORDER"
    DATA_SIZE_MISMATCH = "DATA_SIZE_MISMATCH"
    GROUP_NAME_INVALID = "GROUP_NAME_INVALID"
    MASTER_ADDRESS_INVALID = "MASTER_ADDRESS_INVALID"
    GROUP_SIZE_INVALID = "GROUP_SIZE_INVALID"
    GROUP_BACKEND_REQUIRED = "GROUP_BACKEND_REQUIRED"
    BACKEND_UNAVAILABLE = "BACKEND_UNAVAILABLE"
    GROUP_EXISTS = "GROUP_EXISTS"
    TOO_MANY_GROUPS = "TOO_MANY_GROUPS"
    GROUP_INIT_FAILED = "GROUP_INIT_FAILED"
    GROUP_IN_USE = "GROUP_IN_USE"
    GROUP_BROKEN = "GROUP_BROKEN"
    OPERATION_NAME_INVALID = "OPERATION_NAME_INVALID"
    OPERATION_NOT_FOUND = "OPERATION_NOT_FOUND"
    OPERATION_RUNNING = "OPERATION_RUNNING"
    PAGE_SIZE_INVALID = "PAGE_SIZE_INVALID"
    PAGE_TOKEN_INVALID = "PAGE_TOKEN_INVALID"
    PATH_NOT_ALLOWED = "PATH_NOT_ALLOWED"
    UNSUPPORTED_FORMAT = "UNSUPPORTED_FORMAT"
    NOT_A_REGULAR_FILE = "NOT_A_REGULAR_FILE"  # a FIFO, socket or device where a file must be
    TENSOR_MISMATCH = "TENSOR_MISMATCH"
    GROUP_NOT_FOUND = "GROUP_NOT_FOUND"
    GROUP_TIMEOUT = "GROUP_TIMEOUT"
    PARTIAL_UPDATE = "PARTIAL_UPDATE"
    # FPM identity
    IDENTITY_SYNC_FAILED = "IDENTITY_SYNC_FAILED"
    IDENTITY_READ_FAILED = "IDENTITY_READ_FAILED"
    WORKER_ID_REQUIRED = "WORKER_ID_REQUIRED"
    WORKER_ID_TOO_LONG = "WORKER_ID_TOO_LONG"
    WORKER_ID_INVALID = "WORKER_ID_INVALID"
    TIMEOUT_INVALID = "TIMEOUT_INVALID"
    # FPM stream (ForwardPassMetricsService)
    FILTER_INVALID = "FILTER_INVALID"
    MAX_BATCH_SIZE_TOO_LARGE = "MAX_BATCH_SIZE_TOO_LARGE"
    SEQUENCE_EVICTED = "SEQUENCE_EVICTED"
    SEQUENCE_IN_FUTURE = "SEQUENCE_IN_FUTURE"
    INCARNATION_CHANGED = "INCARNATION_CHANGED"  # also WatchWeightVersion
    # Any RPC
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    ENGINE_DEAD = "ENGINE_DEAD"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    SHUTTING_DOWN = "SHUTTING_DOWN"


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field (`google.rpc.BadRequest.FieldViolation`)."""

    field: str
    description: str


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
