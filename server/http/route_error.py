"""RouteError: what a route answers instead of a success, with the gRPC status it stands for.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server). A route
raises it for a bad argument (server/http/body.py) or a refusal of its own; a call the
control plane refused (CallAborted, server/local_plane.py) or an Operation that failed is
read into one by `status_error`, with the code, reason, message, ErrorInfo metadata and
BadRequest violations the servicer answered. server/http/answers.py turns it into a JSON
body and an HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2

from enginectl.server.servicer_context import status_code


@dataclass
class RouteError(Exception):
    """A call the control plane refused or failed, as its google.rpc.Status said."""

    code: grpc.StatusCode
    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)
    violations: list[dict[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


def status_error(status: status_pb2.Status) -> RouteError:
    """The RouteError a google.rpc.Status (an RPC's or an Operation's) stands for."""
    code = status_code(status)
    error = RouteError(code, code.name, status.message)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            error.reason, error.metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            error.violations = [{"field": v.field, "description": v.description} for v in bad.field_violations]
    return error
