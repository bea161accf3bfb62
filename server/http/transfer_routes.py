"""vLLM's weight-transfer routes, as enginectl's: each calls the RPC a gRPC client would.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server); attached by
server/http/routes.py. The names and bodies are vLLM's (`vllm/entrypoints/rl/online/api_router.py`,
which vLLM's `HTTPVLLMWeightSyncClient` calls): `/init_weight_transfer_engine {init_info}`,
`/start_weight_update`, `/update_weights {update_info}`, `/finish_weight_update
{weight_version?}`, `/shutdown_weight_transfer_engine`. Each runs through
WeightUpdateService's transfer RPCs (server/weights/transfer.py), so a round is an enginectl
update: versions through the ledger, etag fencing, request ids, pause modes, deadlines, the
partial rule. Beyond vLLM's bodies, `/start_weight_update` takes enginectl's update options
(`weight_version`, `etag`, `request_id`, `mode`, `reset_prefix_cache`, `timeout`,
`step_timeout`) and `/finish_weight_update` an `etag` (docs/http_routes.md). An update's
`update_info` crosses as the JSON it came as (`update_info_json`), so its integers stay exact
at any size.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server import limits
from enginectl.server.http.answers import ok, updated
from enginectl.server.http.body import Body, bad, set_timeout, update_options
from enginectl.server.http.route_calls import RouteCalls
from enginectl.server.http.router import Router
from enginectl.weights.v1 import weight_update_service_pb2 as upd

router = Router()


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request, calls: RouteCalls) -> Response:
    """vLLM `POST /init_weight_transfer_engine {"init_info": {...}}`."""
    caller = calls.caller(request)
    body = await Body.read(request)
    init_info = body.value("init_info")
    if not isinstance(init_info, dict):
        raise bad("init_info", "a JSON object: the transfer engine's init info", Reason.TRANSFER_INIT_INVALID)
    message = upd.InitWeightTransferEngineRequest()
    message.init_info.update(init_info)
    bound = set_timeout(body, "timeout", message)
    answer = await calls.plane.weight_update.init_weight_transfer_engine(message, caller, timeout=bound + 40.0)
    return ok(backend=answer.backend, num_workers=answer.num_workers)


@router.post("/start_weight_update")
async def start_weight_update(request: Request, calls: RouteCalls) -> Response:
    """vLLM `POST /start_weight_update`: opens a round (its Operation's name answered)."""
    caller = calls.caller(request)
    body = await Body.read(request)
    message = upd.StartWeightUpdateRequest(
        etag=body.string("etag", "") or "", request_id=body.string("request_id", "") or ""
    )
    update_options(body, message)
    set_timeout(body, "timeout", message)
    step = body.number("step_timeout")
    if step is not None:
        if step <= 0 or step > limits.MAX_TIMEOUT_S:
            raise bad("step_timeout", f"must be in (0, {limits.MAX_TIMEOUT_S:g}] seconds", Reason.TIMEOUT_INVALID)
        message.step_timeout.FromMilliseconds(int(step * 1000))
    message.stage_only = body.flag("stage_only")
    op = await calls.plane.weight_update.start_weight_update(message, caller)
    return ok(operation=op.name)


@router.post("/update_weights")
async def update_weights(request: Request, calls: RouteCalls) -> Response:
    """vLLM `POST /update_weights {"update_info": {...} | [...]}`: one batch of the round."""
    caller = calls.caller(request)
    body = await Body.read(request)
    info = body.value("update_info")
    if not isinstance(info, (dict, list)):
        raise bad("update_info", "a JSON object (or a list of them, one per worker)")
    message = upd.UpdateWeightsRequest(
        name=body.string("operation", "") or "", update_info_json=json.dumps(info).encode()
    )
    answer = await calls.plane.weight_update.update_weights(message, caller, timeout=limits.MAX_TIMEOUT_S)
    return ok(batches=answer.batches)


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, calls: RouteCalls) -> Response:
    """vLLM `POST /finish_weight_update {"weight_version"?}`: answered when the round is
    recorded (or failed)."""
    caller = calls.caller(request)
    body = await Body.read(request)
    message = upd.FinishWeightUpdateRequest(name=body.string("operation", "") or "", etag=body.string("etag", "") or "")
    version = body.string("weight_version")
    if version is not None:
        message.weight_version = version
    op = await calls.plane.weight_update.finish_weight_update(message, caller, timeout=limits.MAX_TIMEOUT_S)
    return updated(await calls.finished(op, caller, limits.MAX_TIMEOUT_S))


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request, calls: RouteCalls) -> Response:
    """vLLM `POST /shutdown_weight_transfer_engine`."""
    caller = calls.caller(request)
    answer = await calls.plane.weight_update.shutdown_weight_transfer_engine(
        upd.ShutdownWeightTransferEngineRequest(), caller
    )
    return ok(found=answer.found)
