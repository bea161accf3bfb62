"""The HTTP RL routes over an engine-free control plane, in process (no socket, no engine).

The routes reach the control plane through its typed door (server/local_plane.py) and local
endpoint (server/local_endpoint.py): the same interceptor as the gRPC port, so the token, the
no-engine refusal and the refusal after engine death answer here exactly as there, as JSON
with the HTTP status of the code (docs/http_routes.md). A transfer round runs here against the
in-memory engine (tests/support/engine_double.py). The end-to-end behaviour on a real engine
is in tests/e2e/weight_updates/test_http_routes.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from support.engine_double import EngineDouble

from enginectl.common.vocabulary import Reason
from enginectl.contract.engine import TransferAnswer, TransferStep
from enginectl.server.errors import ControlPlaneError, to_status
from enginectl.server.grpc_server import ControlPlaneServer
from enginectl.server.http.answers import HTTP_STATUS, http_status
from enginectl.server.http.route_calls import RouteCalls
from enginectl.server.http.route_error import status_error
from enginectl.server.http.routes import REFUSED, mount
from enginectl.server.local_plane import LocalPlane
from enginectl.server.weights.sources.disk import TensorInfo
from enginectl.server.weights.transfer import WeightTransfer
from enginectl.server.weights.update.operations import OperationStore
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2

TOKEN = "s3cret-token"


@pytest.fixture
async def plane() -> AsyncIterator[ControlPlaneServer]:
    server = ControlPlaneServer(WeightVersionLedger(), token=TOKEN)
    await server.set_serving(True)
    yield server
    await server.stop(0)


@pytest.fixture
async def http(plane: ControlPlaneServer) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    mount(app, _calls(plane))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://routes") as client:
        yield client


def _calls(plane: ControlPlaneServer) -> RouteCalls:
    return RouteCalls(LocalPlane(plane.local, asyncio.get_running_loop()))


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_declaration_needs_the_token_and_a_refusal_changes_nothing(
    plane: ControlPlaneServer, http: httpx.AsyncClient
) -> None:
    before = plane.ledger.state
    for headers in ({}, _auth("wrong")):
        answer = await http.post("/update_weight_version", json={"new_version": "v1"}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"] == Reason.UNAUTHENTICATED
    assert plane.ledger.state == before

    answer = await http.post("/update_weight_version", json={"new_version": "v1"}, headers=_auth())
    assert answer.status_code == 200 and answer.json()["new_version"] == "v1"
    state = plane.ledger.state
    assert state.declared and state.version == "v1"

    stale = await http.post(
        "/engine/set_weight_version", json={"weight_version": "v2", "etag": before.etag}, headers=_auth()
    )
    body = stale.json()
    assert (stale.status_code, body["error"]) == (409, Reason.ETAG_MISMATCH)
    assert body["details"]["current_etag"] == state.etag and body["success"] is False and body["status"] == "error"
    assert plane.ledger.state == state

    read = (await http.get("/engine/get_weight_version")).json()  # reads need no token
    assert (read["version"], read["version_declared"]) == ("v1", True)


async def test_undeclared_is_null_never_a_placeholder(http: httpx.AsyncClient) -> None:
    assert (await http.get("/get_weight_version")).json()["weight_version"] is None
    assert (await http.get("/weight_info")).json()["weight_version"] is None
    dynamo = (await http.get("/engine/get_weight_version")).json()
    assert dynamo["version"] is None and dynamo["version_declared"] is False


async def test_without_an_engine_the_update_routes_answer_not_implemented(
    plane: ControlPlaneServer, http: httpx.AsyncClient
) -> None:
    for path, body in [("/pause", {}), ("/update_weights_from_disk", {"model_path": "/x"}), ("/is_paused", None)]:
        answer = await (http.get(path) if body is None else http.post(path, json=body, headers=_auth()))
        assert (answer.status_code, answer.json()["error"]) == (501, Reason.NOT_IMPLEMENTED), path


async def test_after_engine_death_every_route_answers_engine_dead(
    plane: ControlPlaneServer, http: httpx.AsyncClient
) -> None:
    await plane.engine_dead("EngineCore_DP0 was killed")
    for answer in (
        await http.get("/get_weight_version"),
        await http.post("/update_weight_version", json={"new_version": "x"}, headers=_auth()),
    ):
        assert (answer.status_code, answer.json()["error"]) == (503, Reason.ENGINE_DEAD)
        assert "killed" in answer.json()["message"]
    probe = await http.get("/engine/liveness_probe")
    assert probe.status_code == 503 and probe.json()["error"] == Reason.NOT_SERVING


@pytest.mark.parametrize("path", sorted(REFUSED))
async def test_vllm_dev_routes_are_refused_with_a_reason(http: httpx.AsyncClient, path: str) -> None:
    answer = await http.post(path, json={}, headers=_auth())
    assert (answer.status_code, answer.json()["error"]) == (403, Reason.ROUTE_REFUSED)
    assert answer.json()["details"]["route"] == path


async def test_mount_takes_the_place_of_vllms_routes_at_the_same_paths(plane: ControlPlaneServer) -> None:
    app = FastAPI()

    @app.post("/resume")
    async def vllm_resume() -> dict[str, Any]:  # stands for vLLM's dev route of that path
        return {"status": "resumed by vLLM"}

    replaced, kept = mount(app, _calls(plane))
    assert (replaced, kept) == (["/resume"], [])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://routes") as client:
        answer = await client.post("/resume", json={}, headers=_auth())
    assert answer.json()["error"] == Reason.NOT_IMPLEMENTED  # enginectl's route answered (no engine here)


@pytest.mark.parametrize(
    ("body", "field"),
    [(b"{oops", None), (b"[]", None), (b'{"new_version": 7}', "new_version"), (b'{"etag": "e"}', "new_version")],
)
async def test_bad_bodies_are_malformed_requests(
    plane: ControlPlaneServer, http: httpx.AsyncClient, body: bytes, field: str | None
) -> None:
    before = plane.ledger.state
    answer = await http.post("/update_weight_version", content=body, headers=_auth())
    payload = answer.json()
    assert (answer.status_code, payload["error"]) == (400, Reason.MALFORMED_REQUEST)
    if field is not None:
        assert payload["details"]["field_violations"][0]["field"] == field
    assert plane.ledger.state == before


def test_every_grpc_code_has_an_http_status_and_errors_keep_their_details() -> None:
    assert http_status(grpc.StatusCode.INVALID_ARGUMENT) == 400
    assert http_status(grpc.StatusCode.FAILED_PRECONDITION) == 412
    assert http_status(grpc.StatusCode.DEADLINE_EXCEEDED) == 504
    assert {http_status(code) for code in grpc.StatusCode if code not in HTTP_STATUS} == {500}
    error = ControlPlaneError(
        grpc.StatusCode.ABORTED, Reason.UPDATE_IN_PROGRESS, "busy", metadata={"operation": "operations/1"}
    )
    back = status_error(to_status(error))
    assert (back.code, back.reason, back.message, back.metadata) == (
        grpc.StatusCode.ABORTED,
        Reason.UPDATE_IN_PROGRESS,
        "busy",
        {"operation": "operations/1"},
    )


async def test_once_the_plane_stops_the_routes_answer_shutting_down(
    plane: ControlPlaneServer, http: httpx.AsyncClient
) -> None:
    """vLLM's HTTP server outlives the gRPC server by a few seconds at shutdown: nothing may
    change state through it then."""
    await plane.stop(0)
    before = plane.ledger.state
    answer = await http.post("/update_weight_version", json={"new_version": "late"}, headers=_auth())
    assert (answer.status_code, answer.json()["error"]) == (503, Reason.SHUTTING_DOWN)
    assert plane.ledger.state == before


async def test_allow_vllm_dev_routes_keeps_vllms_weight_routes_but_not_its_rl_names(plane: ControlPlaneServer) -> None:
    app = FastAPI()

    @app.post("/collective_rpc")
    async def vllm_rpc() -> dict[str, Any]:  # stands for vLLM's dev route of that path
        return {"results": ["vLLM's"]}

    @app.post("/pause")
    async def vllm_pause() -> dict[str, Any]:
        return {"status": "paused by vLLM"}

    replaced, kept = mount(app, _calls(plane), keep_vllm_dev_routes=True)
    assert (replaced, kept) == (["/pause"], ["/collective_rpc"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://routes") as client:
        assert (await client.post("/collective_rpc", json={})).json() == {"results": ["vLLM's"]}
        assert (await client.post("/pause", json={}, headers=_auth())).json()["error"] == Reason.NOT_IMPLEMENTED
        assert (await client.post("/sleep", json={})).json()["error"] == Reason.ROUTE_REFUSED  # vLLM has none here


async def test_the_local_plane_calls_rpcs_the_server_serves_and_every_weight_update_rpc(
    plane: ControlPlaneServer,
) -> None:
    """The typed calls name RPCs by their descriptors: each is one the server lists in
    GetServerInfo.supported_rpcs (health aside: it is not listed), and WeightUpdateService has
    one for every unary RPC, so an RPC added or renamed without its call fails here."""
    local = LocalPlane(plane.local, asyncio.get_running_loop())
    calls = [
        call for group in (local.weight_version, local.weight_update, local.operations) for call in vars(group).values()
    ]
    assert {call.method for call in calls} <= {f"/{rpc}" for rpc in plane.supported_rpcs}
    (service,) = weight_update_service_pb2.DESCRIPTOR.services_by_name.values()
    unary = {
        f"/{service.full_name}/{m.name}" for m in service.methods if not (m.client_streaming or m.server_streaming)
    }
    assert {call.method for call in vars(local.weight_update).values()} == unary


class _RecordingEngine(EngineDouble):
    """The in-memory engine, keeping each batch's update info as the workers would get it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[object] = []

    async def transfer(self, step: TransferStep, payload: object, timeout: float) -> list[TransferAnswer]:
        if step == TransferStep.UPDATE:
            self.batches.append(payload)
        return await super().transfer(step, payload, timeout)


async def test_update_info_reaches_the_engine_with_its_integers_exact() -> None:
    """vLLM's /update_weights body crosses to the RPC as JSON: an integer above 2^53 (a
    protobuf Struct holds it as a double, 2^53 + 1 -> 2^53) arrives as it was sent."""
    engine = _RecordingEngine()
    ledger = WeightVersionLedger(publish=engine.set_weight_version)
    operations = OperationStore()
    tensor = TensorInfo("w", "float32", (2, 2))
    updates = WeightUpdates(engine, ledger, operations, allowed_roots=[], expected={tensor.name: tensor})
    await updates.prepare()
    server = ControlPlaneServer(
        ledger, token=TOKEN, updates=updates, transfer=WeightTransfer(engine, updates, "gloo"), operations=operations
    )
    await server.set_serving(True)
    app = FastAPI()
    mount(app, _calls(server))
    big = 2**53 + 1
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]], "offsets": [big, -big], "scale": 0.5}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://routes") as http:
            init = {"init_info": {"master_address": "127.0.0.1", "master_port": 29500}}
            assert (await http.post("/init_weight_transfer_engine", json=init, headers=_auth())).status_code == 200
            assert (await http.post("/start_weight_update", json={}, headers=_auth())).status_code == 200
            batch = await http.post("/update_weights", json={"update_info": info}, headers=_auth())
            assert (batch.status_code, batch.json()["batches"]) == (200, 1)
            done = await http.post("/finish_weight_update", json={"weight_version": "v1"}, headers=_auth())
            assert (done.status_code, done.json()["version"]) == (200, "v1")
    finally:
        updates.close()
        await server.stop(0)
    assert engine.batches == [info]
