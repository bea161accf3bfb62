"""vLLM's four weight-transfer routes, as enginectl's: each calls the RPC a gRPC client would.

Runs in the `enginectl serve` process, on vLLM's event loop (the calls hop to the control loop:
local_calls.py). The names and bodies are vLLM's (`vllm/entrypoints/rl/online/api_router.py`,
which vLLM's `HTTPVLLMWeightSyncClient` calls): `/init_weight_transfer_engine {init_info}`,
`/start_weight_update`, `/update_weights {update_info}`, `/finish_weight_update
{weight_version?}`, `/shutdown_weight_transfer_engine`. Each runs through
WeightUpdateService's transfer RPCs (server/weights/transfer.py), so a round is an enginectl
update: versions through the ledger, etag fencing, request ids, pause modes, deadlines, the
partial rule. Beyond vLLM's bodies, `/start_weight_update` takes enginectl's update options
(`weight_version`, `etag`, `request_id`, `mode`, `reset_prefix_cache`, `timeout`,
`step_timeout`) and `/finish_weight_update` an `etag` (docs/http_routes.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from google.longrunning import operations_pb2
from google.protobuf import json_format, struct_pb2
from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server import limits
from enginectl.server.http.answers import ok
from enginectl.server.http.body import Body, bad, set_timeout, update_options
from enginectl.server.http.local_calls import LocalCalls, RouteError, status_error
from enginectl.weights.v1 import weight_update_service_pb2 as upd

WEIGHT_UPDATE = "/enginectl.weights.v1.WeightUpdateService/"

Handler = Callable[[Request], Awaitable[Response]]
Guard = Callable[[Request], tuple[str | None, str | None]]
Answered = Callable[[upd.UpdateWeightsResponse], Response]


class TransferRoutes:
    """The five routes over `calls`; `guard` reads the caller's headers (RlRoutes._guard),
    `answered` turns a finished round into the JSON every update route answers."""

    def __init__(self, calls: LocalCalls, guard: Guard, answered: Answered) -> None:
        self._calls, self._guard, self._answered = calls, guard, answered

    def table(self) -> list[tuple[str, tuple[str, ...], Handler]]:
        return [
            ("/init_weight_transfer_engine", ("POST",), self.init_weight_transfer_engine),
            ("/start_weight_update", ("POST",), self.start_weight_update),
            ("/update_weights", ("POST",), self.update_weights),
            ("/finish_weight_update", ("POST",), self.finish_weight_update),
            ("/shutdown_weight_transfer_engine", ("POST",), self.shutdown_weight_transfer_engine),
        ]

    async def init_weight_transfer_engine(self, request: Request) -> Response:
        """vLLM `POST /init_weight_transfer_engine {"init_info": {...}}`."""
        auth, rid = self._guard(request)
        body = await Body.read(request)
        init_info = body.value("init_info")
        if not isinstance(init_info, dict):
            raise bad("init_info", "a JSON object: the transfer engine's init info", Reason.TRANSFER_INIT_INVALID)
        message = upd.InitWeightTransferEngineRequest()
        message.init_info.update(init_info)
        bound = set_timeout(body, "timeout", message)
        answer = await self._calls.call(
            WEIGHT_UPDATE + "InitWeightTransferEngine",
            message,
            upd.InitWeightTransferEngineResponse,
            authorization=auth,
            request_id=rid,
            timeout=bound + 40.0,
        )
        return ok(backend=answer.backend, num_workers=answer.num_workers)

    async def start_weight_update(self, request: Request) -> Response:
        """vLLM `POST /start_weight_update`: opens a round (its Operation's name answered)."""
        auth, rid = self._guard(request)
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
        op = await self._calls.call(
            WEIGHT_UPDATE + "StartWeightUpdate",
            message,
            operations_pb2.Operation,
            authorization=auth,
            request_id=rid,
        )
        return ok(operation=op.name)

    async def update_weights(self, request: Request) -> Response:
        """vLLM `POST /update_weights {"update_info": {...} | [...]}`: one batch of the round."""
        auth, rid = self._guard(request)
        body = await Body.read(request)
        info = body.value("update_info")
        if not isinstance(info, (dict, list)):
            raise bad("update_info", "a JSON object (or a list of them, one per worker)")
        value = struct_pb2.Value()
        json_format.ParseDict(cast(Any, info), value)
        answer = await self._calls.call(
            WEIGHT_UPDATE + "UpdateWeights",
            upd.UpdateWeightsRequest(name=body.string("operation", "") or "", update_info=value),
            upd.UpdateWeightsBatchResponse,
            authorization=auth,
            request_id=rid,
            timeout=limits.MAX_TIMEOUT_S,
        )
        return ok(batches=answer.batches)

    async def finish_weight_update(self, request: Request) -> Response:
        """vLLM `POST /finish_weight_update {"weight_version"?}`: answered when the round is
        recorded (or failed)."""
        auth, rid = self._guard(request)
        body = await Body.read(request)
        message = upd.FinishWeightUpdateRequest(
            name=body.string("operation", "") or "", etag=body.string("etag", "") or ""
        )
        version = body.string("weight_version")
        if version is not None:
            message.weight_version = version
        op = await self._calls.call(
            WEIGHT_UPDATE + "FinishWeightUpdate",
            message,
            operations_pb2.Operation,
            authorization=auth,
            request_id=rid,
            timeout=limits.MAX_TIMEOUT_S,
        )
        if op.HasField("error"):
            raise _operation_error(op)
        answer = upd.UpdateWeightsResponse()
        op.response.Unpack(answer)
        return self._answered(answer)

    async def shutdown_weight_transfer_engine(self, request: Request) -> Response:
        """vLLM `POST /shutdown_weight_transfer_engine`."""
        auth, rid = self._guard(request)
        answer = await self._calls.call(
            WEIGHT_UPDATE + "ShutdownWeightTransferEngine",
            upd.ShutdownWeightTransferEngineRequest(),
            upd.ShutdownWeightTransferEngineResponse,
            authorization=auth,
            request_id=rid,
        )
        return ok(found=answer.found)


def _operation_error(op: Any) -> RouteError:
    error = status_error(op.error)
    error.metadata.setdefault("operation", op.name)
    return error
