"""SGLang's route names (also what SMG's `smg.rl` sends), each one of enginectl's RPCs:
/pause_generation, /continue_generation, /update_weights_from_disk,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/flush_cache, /get_weight_version, /get_server_info (its /update_weight_version is vLLM's
route: server/http/vllm_routes.py).

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server); attached by
server/http/routes.py. Every route is a translation: JSON in, the RPCs through RouteCalls
(server/http/route_calls.py), JSON out. docs/http_routes.md is the manual, with where a name
means something else in SGLang.
"""

from __future__ import annotations

import grpc
from google.protobuf import json_format
from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server.http.answers import ok, version_json
from enginectl.server.http.body import GROUP_BACKENDS, LOAD_FORMATS, Body, bad, set_timeout
from enginectl.server.http.route_calls import RouteCalls, pausing, resuming
from enginectl.server.http.route_error import RouteError
from enginectl.server.http.router import Router
from enginectl.server.local_plane import Caller
from enginectl.weights.v1 import weight_update_service_pb2 as upd

router = Router()


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, calls: RouteCalls) -> Response:
    """SGLang `POST /update_weights_from_disk {model_path, weight_version, ...}`: answered
    when the update is done (bounded by its `timeout`)."""
    body = await Body.read(request)
    caller = calls.caller(request)
    if body.string("load_format") not in LOAD_FORMATS:
        raise bad("load_format", "only safetensors weights are loaded", Reason.LOAD_FORMAT_UNSUPPORTED)
    message = upd.UpdateWeightsFromDiskRequest(path=body.string("model_path", required=True) or "")
    return await calls.update(calls.plane.weight_update.update_weights_from_disk, message, body, caller)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, calls: RouteCalls) -> Response:
    """SGLang `POST /init_weights_update_group {master_address, master_port, rank_offset,
    world_size, group_name, backend}` (backend defaults to nccl, as SGLang's)."""
    body = await Body.read(request)
    caller = calls.caller(request)
    backend = (body.string("backend", "nccl") or "").lower()
    if backend not in GROUP_BACKENDS:
        raise bad("backend", f"one of {', '.join(GROUP_BACKENDS)}")
    message = upd.InitWeightsUpdateGroupRequest(
        group_name=body.string("group_name", required=True) or "",
        master_address=body.string("master_address", required=True) or "",
        master_port=body.integer("master_port", required=True) or 0,
        rank_offset=body.integer("rank_offset", required=True) or 0,
        world_size=body.integer("world_size", required=True) or 0,
        backend=GROUP_BACKENDS[backend],
    )
    within = set_timeout(body, "timeout", message)
    answer = await calls.plane.weight_update.init_weights_update_group(message, caller, timeout=within + 5.0)
    return ok(message="group joined", group=json_format.MessageToDict(answer.group, preserving_proto_field_name=True))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, calls: RouteCalls) -> Response:
    """SGLang `POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
    weight_version, flush_cache, ...}`: answered when every tensor was received and loaded
    (the trainer broadcasts meanwhile)."""
    body = await Body.read(request)
    caller = calls.caller(request)
    names, dtypes = body.strings("names"), body.strings("dtypes")
    shapes = body.value("shapes")
    if not isinstance(shapes, list) or len(shapes) != len(names) or len(dtypes) != len(names):
        raise bad("shapes", "names, dtypes and shapes must be lists of one length", Reason.TENSOR_SPEC_INVALID)
    message = upd.UpdateWeightsFromDistributedRequest(group_name=body.string("group_name", required=True) or "")
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        member = f"TENSOR_DTYPE_{dtype.removeprefix('torch.').upper()}"
        if member not in upd.TensorDtype.keys():
            raise bad(f"dtypes[{i}]", f"unknown dtype {dtype!r}", Reason.TENSOR_SPEC_INVALID)
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise bad(f"shapes[{i}]", "must be a list of integers", Reason.TENSOR_SPEC_INVALID)
        message.tensors.add(name=name, dtype=upd.TensorDtype.Value(member), shape=shape)
    return await calls.update(calls.plane.weight_update.update_weights_from_distributed, message, body, caller)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, calls: RouteCalls) -> Response:
    """SGLang `POST /destroy_weights_update_group {group_name}`."""
    body = await Body.read(request)
    caller = calls.caller(request)
    message = upd.DestroyWeightsUpdateGroupRequest(
        group_name=body.string("group_name", required=True) or "", allow_missing=body.flag("allow_missing")
    )
    answer = await calls.plane.weight_update.destroy_weights_update_group(message, caller)
    return ok(message="group destroyed" if answer.found else "no such group", found=answer.found)


@router.post("/flush_cache")
async def flush_cache(request: Request, calls: RouteCalls) -> Response:
    """SGLang `POST /flush_cache {timeout_s}`: vLLM's FlushCache (every rank's prefix cache)."""
    body = await Body.read(request)
    caller = calls.caller(request)
    from smg_grpc_proto.generated import common_pb2

    message = common_pb2.FlushCacheRequest(timeout_s=body.number("timeout_s") or 0.0)
    answer = await calls.plane.vllm_engine.flush_cache(message, caller)
    if not answer.success:
        raise RouteError(grpc.StatusCode.FAILED_PRECONDITION, Reason.FLUSH_FAILED, answer.message or "not flushed")
    return ok(message=answer.message or "cache flushed")


@router.get("/get_weight_version")
async def get_weight_version(request: Request, calls: RouteCalls) -> Response:
    """SGLang `GET /get_weight_version`: null while undeclared."""
    version = version_json(await calls.version())
    return ok(weight_version=version["version"], declared=version["declared"], revision=version["revision"])


@router.get("/get_server_info")
async def get_server_info(request: Request, calls: RouteCalls) -> Response:
    """SGLang `GET /get_server_info`: enginectl's GetServerInfo, with `weight_version` (only
    when declared) and `is_paused`."""
    reader = Caller(request.headers.get("authorization"))  # a read: the token shows more, if given
    info = await calls.plane.weight_update.get_server_info(upd.GetServerInfoRequest(), reader)
    fields = json_format.MessageToDict(info, preserving_proto_field_name=True)
    version = version_json(await calls.version())
    if version["declared"]:
        fields["weight_version"] = version["version"]
    fields["is_paused"] = (await calls.state()).paused
    return ok(**fields)


# Pause and resume: one route under each vocabulary's names (server/http/route_calls.py).
router.post("/pause_generation")(pausing("SGLang", "abort", message="generation paused"))
router.post("/continue_generation")(resuming("SGLang", message="generation resumed"))
