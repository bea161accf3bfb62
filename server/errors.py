"""Domain errors raised by the server's core, and their google.rpc.Status form.

Runs in the `enginectl serve` process. The core (ledger, engine adapter) raises
`ControlPlaneError`; the gRPC interceptor turns it into a status with ErrorInfo and
BadRequest details, so servicers never build statuses by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from enginectl.common.vocabulary import DOMAIN, FieldViolation, Reason
from enginectl.server.limits import MAX_ERROR_MESSAGE_BYTES, MAX_ERROR_METADATA_VALUE_BYTES, MAX_ERROR_STATUS_BYTES

__all__ = ["ControlPlaneError", "CallAborted", "Reason", "FieldViolation", "to_status", "invalid_field", "out_of_range"]


class ControlPlaneError(Exception):
    """A request the server refuses or cannot complete, with a stable reason."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        *,
        metadata: Mapping[str, str] | None = None,
        field_violations: Sequence[FieldViolation] = (),
        details: Sequence[Message] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = dict(metadata or {})
        self.field_violations = tuple(field_violations)
        self.details = tuple(details)  # further status details, e.g. IdentitySyncFailure

    def __repr__(self) -> str:
        return f"ControlPlaneError({self.code.name}, {self.reason}, {self.message!r})"


class CallAborted(Exception):
    """A call made inside the process (server/local_endpoint.py) ended with `status`, the
    google.rpc.Status a gRPC client would have received."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


def invalid_field(reason: str, field: str, description: str) -> ControlPlaneError:
    """INVALID_ARGUMENT for one bad field, with a BadRequest violation naming it."""
    return ControlPlaneError(
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
        f"{field}: {description}",
        field_violations=[FieldViolation(field, description)],
    )


def out_of_range(reason: str, message: str, **metadata: str) -> ControlPlaneError:
    """OUT_OF_RANGE for a resume point a history no longer (or does not yet) hold: a watch's
    revision, a metrics stream's sequence. `metadata` says where the history is now."""
    return ControlPlaneError(grpc.StatusCode.OUT_OF_RANGE, reason, message, metadata=metadata)


def to_status(err: ControlPlaneError) -> status_pb2.Status:
    """The google.rpc.Status (ErrorInfo + BadRequest) for a ControlPlaneError, bounded so it
    fits gRPC's trailers (server/limits.py, "error statuses"): the message and each metadata
    value are clipped, and field violations beyond the budget are left out and counted in
    ErrorInfo.metadata["field_violations_omitted"] (the message says how many there were)."""
    message = _clip(err.message, MAX_ERROR_MESSAGE_BYTES)
    metadata = {key: _clip(value, MAX_ERROR_METADATA_VALUE_BYTES) for key, value in err.metadata.items()}
    violations = [
        error_details_pb2.BadRequest.FieldViolation(
            field=_clip(v.field, MAX_ERROR_METADATA_VALUE_BYTES),
            description=_clip(v.description, MAX_ERROR_METADATA_VALUE_BYTES),
        )
        for v in err.field_violations
    ]
    kept = len(violations)
    while True:
        info_metadata = dict(metadata)
        if kept < len(violations):
            info_metadata["field_violations_omitted"] = str(len(violations) - kept)
        details = [_pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=info_metadata))]
        if kept:
            details.append(_pack(error_details_pb2.BadRequest(field_violations=violations[:kept])))
        details.extend(_pack(detail) for detail in err.details)
        status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=message, details=details)
        if status.ByteSize() <= MAX_ERROR_STATUS_BYTES or kept == 0:
            return status
        kept = max(0, min(kept - 1, kept * MAX_ERROR_STATUS_BYTES // status.ByteSize()))


def _clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 (on a character boundary), "…" marking a cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "…"


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed
