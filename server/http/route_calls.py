"""RouteCalls: the control-plane calls that routes of every vocabulary make the same way.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server). A route of
any vocabulary (vLLM's, SGLang's, Dynamo's, the transfer routes) is handed this object: the
typed door into the control plane (`plane`, server/local_plane.py) and the steps that several
names share: who calls (the token, the request id), a declaration, an update answered when its
Operation is done, the version and pause state read. The pause and resume routes, one route
under each vocabulary's name, are made here too (`pausing`, `resuming`). Nothing here keeps
state or touches weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.longrunning import operations_pb2
from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server.http.answers import ok, paused_fields, updated
from enginectl.server.http.body import Body, pause_mode, set_timeout, update_options
from enginectl.server.http.route_error import RouteError, status_error
from enginectl.server.local_plane import Caller, LocalPlane, UnaryCall
from enginectl.weights.v1 import weight_update_service_pb2 as upd
from enginectl.weights.v1 import weight_version_pb2
from enginectl.weights.v1 import weight_version_service_pb2 as ver

# One WaitOperation while an update runs; repeated until the update is done.
WAIT_SLICE_S = 30.0

# A route: the HTTP request and the RouteCalls it calls through, its answer.
Handler = Callable[[Request, "RouteCalls"], Awaitable[Response]]

# The requests of the update RPCs the routes start and answer once done.
Update = TypeVar("Update", upd.UpdateWeightsFromDiskRequest, upd.UpdateWeightsFromDistributedRequest)


class RouteCalls:
    """The routes' calls over `plane`. `refusal`: when set, every route that changes state
    answers UNAUTHENTICATED with it (a server whose gRPC callers prove themselves with client
    certificates and no token: HTTP has no such proof)."""

    def __init__(self, plane: LocalPlane, *, refusal: str | None = None) -> None:
        self.plane = plane
        self._refusal = refusal

    def caller(self, request: Request) -> Caller:
        """Who calls a route that changes state: its Authorization, X-Request-Id and User-Agent
        headers, and the client's address."""
        if self._refusal is not None:
            raise RouteError(grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, self._refusal)
        client = request.client
        return Caller(
            request.headers.get("authorization"),
            request.headers.get("x-request-id"),
            peer=f"http:{client.host}:{client.port}" if client is not None else "http",
            user_agent=request.headers.get("user-agent"),
        )

    async def version(self) -> weight_version_pb2.WeightVersion:
        return (await self.plane.weight_version.get_weight_version(ver.GetWeightVersionRequest())).weight_version

    async def state(self) -> upd.GenerationState:
        return (await self.plane.weight_update.get_generation_state(upd.GetGenerationStateRequest())).state

    async def declare(self, request: Request, body: Body, key: str) -> ver.SetWeightVersionResponse:
        """SetWeightVersion with the body's `key`. It never aborts a request; with
        `abort_all_requests: true` (SGLang's default, asked for explicitly here) running
        requests are aborted first and generation resumes after, unless it was paused."""
        caller = self.caller(request)
        message = ver.SetWeightVersionRequest(
            version=body.string(key, required=True) or "",
            etag=body.string("etag", "") or "",
            request_id=body.string("request_id", "") or "",
        )
        declare = self.plane.weight_version.set_weight_version
        if not body.flag("abort_all_requests"):
            return await declare(message, caller)
        generation = self.plane.weight_update
        paused = await generation.pause_generation(upd.PauseGenerationRequest(mode=upd.PAUSE_MODE_ABORT), caller)
        try:
            return await declare(message, caller)
        finally:
            if not paused.was_paused:
                await generation.resume_generation(upd.ResumeGenerationRequest(), Caller(caller.authorization))

    async def update(
        self, start: UnaryCall[Update, operations_pb2.Operation], message: Update, body: Body, caller: Caller
    ) -> Response:
        """An update RPC (`start`) with the options every update takes (etag, request_id,
        stage_only, version, pause mode, prefix cache, timeout), answered when its Operation is
        done. `caller`: from `caller()`, taken before the body was read into `message`."""
        message.etag = body.string("etag", "") or ""
        message.request_id = body.string("request_id", "") or ""
        message.stage_only = body.flag("stage_only")
        update_options(body, message)
        within = set_timeout(body, "timeout", message)
        op = await start(message, caller)
        return updated(await self.finished(op, caller, within))

    async def finished(self, op: operations_pb2.Operation, caller: Caller, within: float) -> upd.UpdateWeightsResponse:
        """The response of the update Operation `op` once done (an HTTP caller neither
        streams nor polls), or RouteError with its error. `within`: how long the update may
        take (its own timeout); waiting ends a little after."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within + WAIT_SLICE_S
        while not op.done:
            left = deadline - loop.time()
            if left <= 0:
                raise RouteError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    Reason.UPDATE_TIMEOUT,
                    f"{op.name} did not finish within its timeout; it may still be running",
                    metadata={"operation": op.name},
                )
            wait = operations_pb2.WaitOperationRequest(name=op.name)
            wait.timeout.FromMilliseconds(int(min(WAIT_SLICE_S, left) * 1000))
            op = await self.plane.operations.wait_operation(
                wait, Caller(caller.authorization), timeout=min(WAIT_SLICE_S, left) + 5.0
            )
        if op.HasField("error"):
            error = status_error(op.error)
            error.metadata.setdefault("operation", op.name)
            raise error
        answer = upd.UpdateWeightsResponse()
        op.response.Unpack(answer)
        return answer


def pausing(vocabulary: str, default_mode: str, **answer: str) -> Handler:
    """`vocabulary`'s pause route: PauseGeneration with the mode the body or query names
    (`default_mode` when none, as `vocabulary`'s), answered with `answer` and its counts."""

    async def pause(request: Request, calls: RouteCalls) -> Response:
        body = await Body.read(request)
        caller = calls.caller(request)
        message = upd.PauseGenerationRequest(mode=pause_mode(body, default_mode), clear_cache=body.flag("clear_cache"))
        bound = set_timeout(body, "wait_timeout", message) + 5.0
        paused = await calls.plane.weight_update.pause_generation(message, caller, timeout=bound)
        return ok(**answer, **paused_fields(paused))

    pause.__doc__ = f"{vocabulary}'s pause: mode {default_mode} unless the body or query names one."
    return pause


def resuming(vocabulary: str, **answer: str) -> Handler:
    """`vocabulary`'s resume route: ResumeGeneration (`force` resumes a quarantined engine),
    answered with `answer` and whether generation was paused."""

    async def resume(request: Request, calls: RouteCalls) -> Response:
        body = await Body.read(request)
        caller = calls.caller(request)
        message = upd.ResumeGenerationRequest(force=body.flag("force"))
        resumed = await calls.plane.weight_update.resume_generation(message, caller)
        return ok(**answer, was_paused=resumed.was_paused)

    resume.__doc__ = f"{vocabulary}'s resume (`force` to resume a quarantined engine, as ResumeGeneration)."
    return resume
