"""Dynamo's engine route names, under /engine/: every vLLM and SGLang name again, with
Dynamo's own meaning where it has one (pause_generation keeps requests by default,
get_weight_version says `version_declared`), and its own resume_generation,
set_weight_version and liveness_probe.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server); attached by
server/http/routes.py. Every route is a translation: JSON in, the RPCs through RouteCalls
(server/http/route_calls.py), JSON out. docs/http_routes.md is the manual. Dynamo answers
every error with HTTP 200; enginectl answers its HTTP status.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server.errors import CallAborted
from enginectl.server.http import sglang_routes, vllm_routes
from enginectl.server.http.answers import ok, version_json
from enginectl.server.http.body import Body
from enginectl.server.http.route_calls import RouteCalls, pausing, resuming
from enginectl.server.http.route_error import RouteError
from enginectl.server.http.router import Router

router = Router()


@router.post("/engine/set_weight_version")
async def set_weight_version(request: Request, calls: RouteCalls) -> Response:
    """Dynamo `POST /engine/set_weight_version {weight_version}`."""
    answer = await calls.declare(request, await Body.read(request), "weight_version")
    version = version_json(answer.weight_version)
    return ok(version=version["version"], weight_version=version)


@router.route("/engine/get_weight_version", "GET", "POST")
async def get_weight_version(request: Request, calls: RouteCalls) -> Response:
    """Dynamo `GET|POST /engine/get_weight_version`: `version` null and `version_declared`
    false until declared."""
    version = version_json(await calls.version())
    return ok(version=version["version"], version_declared=version["declared"], weight_version=version)


@router.route("/engine/liveness_probe", "GET", "POST")
async def liveness_probe(request: Request, calls: RouteCalls) -> Response:
    """Dynamo `/engine/liveness_probe`: 200 while SERVING, else 503 with why."""
    health = await calls.plane.health.check(health_pb2.HealthCheckRequest(service=""))
    if health.status != health_pb2.HealthCheckResponse.SERVING:
        why = "not serving"
        try:
            from smg_grpc_proto import vllm_engine_pb2

            vllm = await calls.plane.vllm_engine.health_check(vllm_engine_pb2.HealthCheckRequest())
            why = vllm.message or why
        except (ImportError, CallAborted):
            pass
        raise RouteError(grpc.StatusCode.UNAVAILABLE, Reason.NOT_SERVING, why)
    return ok(message="serving")


# Pause and resume: one route under each vocabulary's names (server/http/route_calls.py).
router.post("/engine/pause_generation")(pausing("Dynamo", "keep", message="generation paused"))
router.post("/engine/resume_generation")(resuming("Dynamo", message="generation resumed"))
# Then every vLLM and SGLang name under /engine/, but where Dynamo answers it itself.
router.include("/engine", vllm_routes.router, sglang_routes.router)
