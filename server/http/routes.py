"""The HTTP RL routes: vLLM's, SGLang's and Dynamo's route names, each one of enginectl's RPCs.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server, where the
routes are mounted by server/serve.py). Every route is a translation: JSON in, one or more
control-plane RPCs through `LocalCalls` (server/http/local_calls.py: the same interceptor,
servicers, ledger and update state machine a gRPC client reaches), JSON out. Nothing here
keeps state or touches weights. docs/http_routes.md is the manual: every route, its body, its
answer and where a name means something else elsewhere.

Families (docs/http_routes.md, "Route names"):
- vLLM's RL router: /pause?mode=, /resume, /is_paused, /update_weight_version, /weight_info,
  /get_world_size.
- SGLang's (also what SMG's `smg.rl` sends): /pause_generation, /continue_generation,
  /update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
  /destroy_weights_update_group, /update_weight_version, /flush_cache, /get_weight_version,
  /get_server_info.
- Dynamo's, under /engine/: every name above, and resume_generation, set_weight_version,
  get_weight_version (with version_declared), liveness_probe.

vLLM's own dev-mode routes that pause, resume or change weights are replaced by these, or
refused with ROUTE_REFUSED (`mount`): none goes around the ledger.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginectl.common.vocabulary import Reason
from enginectl.server.http.answers import error_response, ok, version_json
from enginectl.server.http.body import GROUP_BACKENDS, LOAD_FORMATS, Body, bad, pause_mode, set_timeout, update_options
from enginectl.server.http.local_calls import LocalCalls, RouteError
from enginectl.server.http.transfer_routes import TransferRoutes
from enginectl.weights.v1 import weight_update_service_pb2 as upd
from enginectl.weights.v1 import weight_version_service_pb2 as ver

WEIGHT_VERSION = "/enginectl.weights.v1.WeightVersionService/"
WEIGHT_UPDATE = "/enginectl.weights.v1.WeightUpdateService/"
VLLM_ENGINE = "/vllm.grpc.engine.VllmEngine/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# vLLM's dev routes (VLLM_SERVER_DEV_MODE=1) that would pause, resume or change weights
# behind the ledger, and what to call instead. Answered PERMISSION_DENIED ROUTE_REFUSED.
REFUSED = {
    "/collective_rpc": "calls worker methods (reload_weights, ...) behind enginectl's ledger",
    "/sleep": "offloads or discards the weights behind enginectl's ledger",
    "/wake_up": "reloads weights behind enginectl's ledger",
    "/release_kv_cache_memory": "puts the engine to sleep behind enginectl's pause state",
    "/weight_checker": "resets weights behind enginectl's ledger; VerifyWeights checks them",
    "/start_draft_weight_update": "a draft model's round is not run through enginectl's ledger yet",
}

Handler = Callable[[Request], Awaitable[Response]]


class RlRoutes:
    """The routes over `calls`. `refusal`: when set, every route that changes state answers
    UNAUTHENTICATED with it (a server whose gRPC callers prove themselves with client
    certificates and no token: HTTP has no such proof)."""

    def __init__(self, calls: LocalCalls, *, refusal: str | None = None) -> None:
        self._calls = calls
        self._refusal = refusal

    # -- plumbing -------------------------------------------------------------------------

    def _guard(self, request: Request) -> tuple[str | None, str | None]:
        """The caller's Authorization and X-Request-Id headers, for a route that changes state."""
        if self._refusal is not None:
            raise RouteError(grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, self._refusal)
        return request.headers.get("authorization"), request.headers.get("x-request-id")

    async def _version(self) -> Any:
        return (
            await self._calls.call(
                WEIGHT_VERSION + "GetWeightVersion", ver.GetWeightVersionRequest(), ver.GetWeightVersionResponse
            )
        ).weight_version

    async def _state(self) -> upd.GenerationState:
        answer = await self._calls.call(
            WEIGHT_UPDATE + "GetGenerationState", upd.GetGenerationStateRequest(), upd.GetGenerationStateResponse
        )
        return answer.state

    async def _pause(self, request: Request, body: Body, default_mode: str) -> upd.PauseGenerationResponse:
        auth, rid = self._guard(request)
        message = upd.PauseGenerationRequest(mode=pause_mode(body, default_mode), clear_cache=body.flag("clear_cache"))
        bound = set_timeout(body, "wait_timeout", message) + 5.0
        return await self._calls.call(
            WEIGHT_UPDATE + "PauseGeneration",
            message,
            upd.PauseGenerationResponse,
            authorization=auth,
            request_id=rid,
            timeout=bound,
        )

    async def _resume(self, request: Request, body: Body) -> upd.ResumeGenerationResponse:
        auth, rid = self._guard(request)
        message = upd.ResumeGenerationRequest(force=body.flag("force"))
        return await self._calls.call(
            WEIGHT_UPDATE + "ResumeGeneration",
            message,
            upd.ResumeGenerationResponse,
            authorization=auth,
            request_id=rid,
        )

    async def _declare(self, request: Request, body: Body, key: str) -> ver.SetWeightVersionResponse:
        """SetWeightVersion with the body's `key`. It never aborts a request; with
        `abort_all_requests: true` (SGLang's default, asked for explicitly here) running
        requests are aborted first and generation resumes after, unless it was paused."""
        auth, rid = self._guard(request)
        message = ver.SetWeightVersionRequest(
            version=body.string(key, required=True) or "",
            etag=body.string("etag", "") or "",
            request_id=body.string("request_id", "") or "",
        )
        if not body.flag("abort_all_requests"):
            return await self._calls.call(
                WEIGHT_VERSION + "SetWeightVersion",
                message,
                ver.SetWeightVersionResponse,
                authorization=auth,
                request_id=rid,
            )
        paused = await self._calls.call(
            WEIGHT_UPDATE + "PauseGeneration",
            upd.PauseGenerationRequest(mode=upd.PAUSE_MODE_ABORT),
            upd.PauseGenerationResponse,
            authorization=auth,
            request_id=rid,
        )
        try:
            return await self._calls.call(
                WEIGHT_VERSION + "SetWeightVersion",
                message,
                ver.SetWeightVersionResponse,
                authorization=auth,
                request_id=rid,
            )
        finally:
            if not paused.was_paused:
                await self._calls.call(
                    WEIGHT_UPDATE + "ResumeGeneration",
                    upd.ResumeGenerationRequest(),
                    upd.ResumeGenerationResponse,
                    authorization=auth,
                )

    async def _update(self, method: str, message: Any, body: Body, guard: tuple[str | None, str | None]) -> Response:
        """An update RPC with the options every update takes (etag, request_id, stage_only,
        version, pause mode, prefix cache, timeout), answered when its Operation is done.
        `guard`: the caller's headers (`_guard`)."""
        auth, rid = guard
        message.etag = body.string("etag", "") or ""
        message.request_id = body.string("request_id", "") or ""
        message.stage_only = body.flag("stage_only")
        update_options(body, message)
        within = set_timeout(body, "timeout", message)
        answer = await self._calls.operation(
            WEIGHT_UPDATE + method,
            message,
            upd.UpdateWeightsResponse,
            authorization=auth,
            request_id=rid,
            within=within,
        )
        return _updated(answer)

    # -- vLLM's names ---------------------------------------------------------------------

    async def pause(self, request: Request) -> Response:
        """vLLM `POST /pause?mode=abort|wait|keep` (default abort, as vLLM's)."""
        answer = await self._pause(request, await Body.read(request), "abort")
        return ok(status="paused", **_paused_fields(answer))

    async def resume(self, request: Request) -> Response:
        """vLLM `POST /resume` (`force` to resume a quarantined engine, as ResumeGeneration)."""
        answer = await self._resume(request, await Body.read(request))
        return ok(status="resumed", was_paused=answer.was_paused)

    async def is_paused(self, request: Request) -> Response:
        """vLLM `GET /is_paused`."""
        state = await self._state()
        return ok(
            is_paused=state.paused, reason=_enum(upd.PauseReason, state.reason), mode=_enum(upd.PauseMode, state.mode)
        )

    async def update_weight_version(self, request: Request) -> Response:
        """vLLM's and SGLang's `POST /update_weight_version {new_version}`: a declaration."""
        answer = await self._declare(request, await Body.read(request), "new_version")
        version = version_json(answer.weight_version)
        return ok(new_version=version["version"], weight_version=version)

    async def weight_info(self, request: Request) -> Response:
        """vLLM `GET /weight_info`: `weight_version` is null while undeclared."""
        version = version_json(await self._version())
        return ok(weight_version=version["version"], **{k: v for k, v in version.items() if k != "version"})

    async def get_world_size(self, request: Request) -> Response:
        """vLLM `GET /get_world_size?include_dp=true`: TP x PP (x DP)."""
        body = await Body.read(request)
        info = await self._calls.call(
            WEIGHT_UPDATE + "GetServerInfo", upd.GetServerInfoRequest(), upd.GetServerInfoResponse
        )
        size = max(info.tensor_parallel_size, 1) * max(info.pipeline_parallel_size, 1)
        if body.flag("include_dp", True):
            size *= max(info.data_parallel_size, 1)
        return ok(world_size=size)

    # -- SGLang's names -------------------------------------------------------------------

    async def pause_generation(self, request: Request) -> Response:
        """SGLang `POST /pause_generation {mode}` (default abort, as SGLang's)."""
        answer = await self._pause(request, await Body.read(request), "abort")
        return ok(message="generation paused", **_paused_fields(answer))

    async def pause_generation_keep(self, request: Request) -> Response:
        """Dynamo `POST /engine/pause_generation {mode}` (default keep, as Dynamo's)."""
        answer = await self._pause(request, await Body.read(request), "keep")
        return ok(message="generation paused", **_paused_fields(answer))

    async def continue_generation(self, request: Request) -> Response:
        """SGLang `POST /continue_generation` (Dynamo: resume_generation)."""
        answer = await self._resume(request, await Body.read(request))
        return ok(message="generation resumed", was_paused=answer.was_paused)

    async def update_weights_from_disk(self, request: Request) -> Response:
        """SGLang `POST /update_weights_from_disk {model_path, weight_version, ...}`: answered
        when the update is done (bounded by its `timeout`)."""
        body = await Body.read(request)
        guard = self._guard(request)
        load_format = body.string("load_format")
        if load_format not in LOAD_FORMATS:
            raise bad("load_format", "only safetensors weights are loaded", Reason.LOAD_FORMAT_UNSUPPORTED)
        message = upd.UpdateWeightsFromDiskRequest(path=body.string("model_path", required=True) or "")
        return await self._update("UpdateWeightsFromDisk", message, body, guard)

    async def init_weights_update_group(self, request: Request) -> Response:
        """SGLang `POST /init_weights_update_group {master_address, master_port, rank_offset,
        world_size, group_name, backend}` (backend defaults to nccl, as SGLang's)."""
        body = await Body.read(request)
        auth, rid = self._guard(request)
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
        answer = await self._calls.call(
            WEIGHT_UPDATE + "InitWeightsUpdateGroup",
            message,
            upd.InitWeightsUpdateGroupResponse,
            authorization=auth,
            request_id=rid,
            timeout=within + 5.0,
        )
        return ok(
            message="group joined", group=json_format.MessageToDict(answer.group, preserving_proto_field_name=True)
        )

    async def update_weights_from_distributed(self, request: Request) -> Response:
        """SGLang `POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
        weight_version, flush_cache, ...}`: answered when every tensor was received and loaded
        (the trainer broadcasts meanwhile)."""
        body = await Body.read(request)
        guard = self._guard(request)
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
        return await self._update("UpdateWeightsFromDistributed", message, body, guard)

    async def destroy_weights_update_group(self, request: Request) -> Response:
        """SGLang `POST /destroy_weights_update_group {group_name}`."""
        body = await Body.read(request)
        auth, rid = self._guard(request)
        message = upd.DestroyWeightsUpdateGroupRequest(
            group_name=body.string("group_name", required=True) or "", allow_missing=body.flag("allow_missing")
        )
        answer = await self._calls.call(
            WEIGHT_UPDATE + "DestroyWeightsUpdateGroup",
            message,
            upd.DestroyWeightsUpdateGroupResponse,
            authorization=auth,
            request_id=rid,
        )
        return ok(message="group destroyed" if answer.found else "no such group", found=answer.found)

    async def flush_cache(self, request: Request) -> Response:
        """SGLang `POST /flush_cache {timeout_s}`: vLLM's FlushCache (every rank's prefix cache)."""
        body = await Body.read(request)
        auth, rid = self._guard(request)
        from smg_grpc_proto.generated import common_pb2

        message = common_pb2.FlushCacheRequest(timeout_s=body.number("timeout_s") or 0.0)
        answer = await self._calls.call(
            VLLM_ENGINE + "FlushCache", message, common_pb2.FlushCacheResponse, authorization=auth, request_id=rid
        )
        if not answer.success:
            raise RouteError(grpc.StatusCode.FAILED_PRECONDITION, Reason.FLUSH_FAILED, answer.message or "not flushed")
        return ok(message=answer.message or "cache flushed")

    async def get_weight_version(self, request: Request) -> Response:
        """SGLang `GET /get_weight_version`: null while undeclared."""
        version = version_json(await self._version())
        return ok(weight_version=version["version"], declared=version["declared"], revision=version["revision"])

    async def get_server_info(self, request: Request) -> Response:
        """SGLang `GET /get_server_info`: enginectl's GetServerInfo, with `weight_version` (only
        when declared) and `is_paused`."""
        info = await self._calls.call(
            WEIGHT_UPDATE + "GetServerInfo",
            upd.GetServerInfoRequest(),
            upd.GetServerInfoResponse,
            authorization=request.headers.get("authorization"),
        )
        fields = json_format.MessageToDict(info, preserving_proto_field_name=True)
        version = version_json(await self._version())
        if version["declared"]:
            fields["weight_version"] = version["version"]
        fields["is_paused"] = (await self._state()).paused
        return ok(**fields)

    # -- Dynamo's names -------------------------------------------------------------------

    async def set_weight_version(self, request: Request) -> Response:
        """Dynamo `POST /engine/set_weight_version {weight_version}`."""
        answer = await self._declare(request, await Body.read(request), "weight_version")
        version = version_json(answer.weight_version)
        return ok(version=version["version"], weight_version=version)

    async def dynamo_weight_version(self, request: Request) -> Response:
        """Dynamo `GET|POST /engine/get_weight_version`: `version` null and `version_declared`
        false until declared."""
        version = version_json(await self._version())
        return ok(version=version["version"], version_declared=version["declared"], weight_version=version)

    async def liveness_probe(self, request: Request) -> Response:
        """Dynamo `/engine/liveness_probe`: 200 while SERVING, else 503 with why."""
        health = await self._calls.call(
            HEALTH_CHECK, health_pb2.HealthCheckRequest(service=""), health_pb2.HealthCheckResponse
        )
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            why = "not serving"
            try:
                from smg_grpc_proto import vllm_engine_pb2

                vllm = await self._calls.call(
                    VLLM_ENGINE + "HealthCheck",
                    vllm_engine_pb2.HealthCheckRequest(),
                    vllm_engine_pb2.HealthCheckResponse,
                )
                why = vllm.message or why
            except (ImportError, RouteError):
                pass
            raise RouteError(grpc.StatusCode.UNAVAILABLE, Reason.NOT_SERVING, why)
        return ok(message="serving")

    def refused(self, path: str) -> Handler:
        why = REFUSED[path]

        async def refuse(request: Request) -> Response:
            raise RouteError(
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.ROUTE_REFUSED,
                f"{path} is refused under enginectl: it {why} (docs/http_routes.md)",
                metadata={"route": path},
            )

        return refuse

    # -- the table --------------------------------------------------------------------------

    def table(self) -> list[tuple[str, tuple[str, ...], Handler]]:
        """(path, methods, handler) of every route, Dynamo's /engine/ copies included."""
        shared: list[tuple[str, tuple[str, ...], Handler]] = [
            ("/pause", ("POST",), self.pause),
            ("/resume", ("POST",), self.resume),
            ("/is_paused", ("GET",), self.is_paused),
            ("/update_weight_version", ("POST",), self.update_weight_version),
            ("/weight_info", ("GET",), self.weight_info),
            ("/get_world_size", ("GET",), self.get_world_size),
            ("/continue_generation", ("POST",), self.continue_generation),
            ("/update_weights_from_disk", ("POST",), self.update_weights_from_disk),
            ("/init_weights_update_group", ("POST",), self.init_weights_update_group),
            ("/update_weights_from_distributed", ("POST",), self.update_weights_from_distributed),
            ("/destroy_weights_update_group", ("POST",), self.destroy_weights_update_group),
            ("/flush_cache", ("POST",), self.flush_cache),
            ("/get_server_info", ("GET",), self.get_server_info),
        ]
        routes = [*shared, ("/pause_generation", ("POST",), self.pause_generation)]
        routes.append(("/get_weight_version", ("GET",), self.get_weight_version))
        routes += [(f"/engine{path}", methods, handler) for path, methods, handler in shared]
        routes += [
            ("/engine/pause_generation", ("POST",), self.pause_generation_keep),
            ("/engine/resume_generation", ("POST",), self.continue_generation),
            ("/engine/set_weight_version", ("POST",), self.set_weight_version),
            ("/engine/get_weight_version", ("GET", "POST"), self.dynamo_weight_version),
            ("/engine/liveness_probe", ("GET", "POST"), self.liveness_probe),
        ]
        routes += TransferRoutes(self._calls, self._guard, _updated).table()
        routes += [(path, ("POST",), self.refused(path)) for path in REFUSED]
        return routes


def _answering(handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except RouteError as error:
            return error_response(error)

    endpoint.__doc__ = handler.__doc__
    return endpoint


def mount(app: Any, routes: RlRoutes, *, keep_vllm_dev_routes: bool = False) -> tuple[list[str], list[str]]:
    """Put `routes` on vLLM's FastAPI `app`, in place of any route of vLLM's at the same path
    (its dev-mode /pause, /resume, /collective_rpc, ...). Returns the paths of vLLM's routes
    replaced, and those kept: with `keep_vllm_dev_routes` (--allow-vllm-dev-routes) vLLM's
    routes of the REFUSED paths stay vLLM's where vLLM has them; the RL names are enginectl's
    all the same."""
    from starlette.routing import Route

    table = routes.table()
    kept: list[str] = []
    if keep_vllm_dev_routes:
        present = {getattr(r, "path", None) for r in app.router.routes}
        kept = sorted(path for path in REFUSED if path in present)
        table = [(path, methods, handler) for path, methods, handler in table if path not in kept]
    ours = {path for path, _, _ in table}
    replaced = sorted({r.path for r in app.router.routes if getattr(r, "path", None) in ours})
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in ours]
    for path, methods, handler in table:
        app.router.routes.append(Route(path, _answering(handler), methods=list(methods), include_in_schema=True))
    app.openapi_schema = None
    return replaced, kept


def _enum(enum: Any, value: int) -> str | None:
    name: str = enum.Name(value)
    return None if name.endswith("_UNSPECIFIED") else name.split("_", 2)[-1].lower()


def _paused_fields(answer: upd.PauseGenerationResponse) -> dict[str, Any]:
    return {
        "was_paused": answer.was_paused,
        "num_aborted_requests": answer.num_aborted_requests,
        "num_paused_requests": answer.num_paused_requests,
    }


def _updated(answer: upd.UpdateWeightsResponse) -> JSONResponse:
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
