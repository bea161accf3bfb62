"""vLLM's RL route names (its `vllm/entrypoints/rl/online/api_router.py`), each one of
enginectl's RPCs: /pause?mode=, /resume, /is_paused, /update_weight_version (SGLang's name
too), /weight_info, /get_world_size.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server); attached by
server/http/routes.py. Every route is a translation: JSON in, the RPCs through RouteCalls
(server/http/route_calls.py), JSON out. docs/http_routes.md is the manual.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from enginectl.server.http.answers import ok, version_json
from enginectl.server.http.body import Body
from enginectl.server.http.route_calls import RouteCalls, pausing, resuming
from enginectl.server.http.router import Router
from enginectl.weights.v1 import weight_update_service_pb2 as upd

router = Router()


@router.get("/is_paused")
async def is_paused(request: Request, calls: RouteCalls) -> Response:
    """vLLM `GET /is_paused`."""
    state = await calls.state()
    return ok(
        is_paused=state.paused, reason=_enum(upd.PauseReason, state.reason), mode=_enum(upd.PauseMode, state.mode)
    )


@router.post("/update_weight_version")
async def update_weight_version(request: Request, calls: RouteCalls) -> Response:
    """vLLM's and SGLang's `POST /update_weight_version {new_version}`: a declaration."""
    answer = await calls.declare(request, await Body.read(request), "new_version")
    version = version_json(answer.weight_version)
    return ok(new_version=version["version"], weight_version=version)


@router.get("/weight_info")
async def weight_info(request: Request, calls: RouteCalls) -> Response:
    """vLLM `GET /weight_info`: `weight_version` is null while undeclared."""
    version = version_json(await calls.version())
    return ok(weight_version=version["version"], **{k: v for k, v in version.items() if k != "version"})


@router.get("/get_world_size")
async def get_world_size(request: Request, calls: RouteCalls) -> Response:
    """vLLM `GET /get_world_size?include_dp=true`: TP x PP (x DP)."""
    body = await Body.read(request)
    info = await calls.plane.weight_update.get_server_info(upd.GetServerInfoRequest())
    size = max(info.tensor_parallel_size, 1) * max(info.pipeline_parallel_size, 1)
    if body.flag("include_dp", True):
        size *= max(info.data_parallel_size, 1)
    return ok(world_size=size)


# Pause and resume: one route under each vocabulary's names (server/http/route_calls.py).
router.post("/pause")(pausing("vLLM", "abort", status="paused"))
router.post("/resume")(resuming("vLLM", status="resumed"))


def _enum(enum: Any, value: int) -> str | None:
    name: str = enum.Name(value)
    return None if name.endswith("_UNSPECIFIED") else name.split("_", 2)[-1].lower()
