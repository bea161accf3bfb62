"""What the HTTP RL routes answer: JSON bodies, and the HTTP status of a gRPC code.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server). Pure
translation, no state: an error is `{"error": REASON, "message": ..., "details": {...}}`
(plus `success: false` and `status: "error"`, which SGLang's and Dynamo's clients read) with
the HTTP status of its gRPC code (docs/http_routes.md, "Errors").
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format
from starlette.responses import JSONResponse

from enginectl.server.http.route_error import RouteError
from enginectl.weights.v1 import weight_update_service_pb2 as upd
from enginectl.weights.v1 import weight_version_pb2

HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a gRPC code (500 for INTERNAL, UNKNOWN, DATA_LOSS)."""
    return HTTP_STATUS.get(code, 500)


def error_response(error: RouteError) -> JSONResponse:
    """The JSON error answer of a refused or failed call."""
    details: dict[str, Any] = {"code": error.code.name, **error.metadata}
    if error.violations:
        details["field_violations"] = error.violations
    body = {"error": error.reason, "message": error.message, "details": details, "success": False, "status": "error"}
    return JSONResponse(body, status_code=http_status(error.code))


def ok(**fields: Any) -> JSONResponse:
    """A success answer: `success: true`, `status: "ok"` unless `fields` say otherwise."""
    body: dict[str, Any] = {"success": True, "status": "ok"}
    body.update(fields)
    return JSONResponse(body)


def version_json(version: weight_version_pb2.WeightVersion) -> dict[str, Any]:
    """A WeightVersion as JSON: `version` is null while undeclared, never a placeholder."""
    return {
        "declared": version.declared,
        "version": version.version if version.declared and version.HasField("version") else None,
        "revision": version.revision,
        "etag": version.etag,
        "incarnation": version.incarnation,
        "source": weight_version_pb2.WeightSource.Name(version.source).removeprefix("WEIGHT_SOURCE_"),
    }


def paused_fields(answer: upd.PauseGenerationResponse) -> dict[str, Any]:
    """What every pause route answers of PauseGeneration."""
    return {
        "was_paused": answer.was_paused,
        "num_aborted_requests": answer.num_aborted_requests,
        "num_paused_requests": answer.num_paused_requests,
    }


def updated(answer: upd.UpdateWeightsResponse) -> JSONResponse:
    """What every update route answers once its update is done."""
    version = version_json(answer.weight_version)
    return ok(
        message=f"weights updated to {version['version']}" if version["declared"] else "weights updated",
        weight_version=version,
        version=version["version"],
        num_paused_requests=answer.num_paused_requests,
        num_aborted_requests=answer.num_aborted_requests,
        prefix_cache_reset=answer.prefix_cache_reset,
        generation_resumed=answer.generation_resumed,
        ranks=[json_format.MessageToDict(r, preserving_proto_field_name=True) for r in answer.ranks],
    )
