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

from enginectl.client.errors import DOMAIN, FieldViolation, Reason

__all__ = ["ControlPlaneError", "Reason", "FieldViolation", "to_status", "invalid_field"]


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


def invalid_field(reason: str, field: str, description: str) -> ControlPlaneError:
    """INVALID_ARGUMENT for one bad field, with a BadRequest violation naming it."""
    return ControlPlaneError(
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
        f"{field}: {description}",
        field_violations=[FieldViolation(field, description)],
    )


def to_status(err: ControlPlaneError) -> status_pb2.Status:
    """The google.rpc.Status (ErrorInfo + BadRequest) for a ControlPlaneError."""
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)
    details = [_pack(info)]
    if err.field_violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in err.field_violations
            ]
        )
        details.append(_pack(bad))
    details.extend(_pack(detail) for detail in err.details)
    return status_pb2.Status(
        code=getattr(code_pb2, err.code.name), message=err.message, details=details
    )


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed
