"""The HTTP RL routes on vLLM's HTTP port (docs/http_routes.md), on the session's weights
server (vLLM dev mode on, no token: the token's refusals are in test_smg_gateway.py).

Each route's answer is checked against its gRPC twin's effect, read back over gRPC; every
refusal leaves the version, the pause state and the generated tokens as they were.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from support.rl_http import call
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens

from enginectl.weights.v1 import weight_update_service_pb2 as upb


def _unchanged(stubs: Stubs, server: ServeProcess, before: Any, tokens: list[int]) -> None:
    assert stubs.version() == before  # version, revision and etag as they were
    assert not stubs.state().paused
    assert greedy_tokens(server) == tokens


def test_vllm_names_pause_resume_and_declare_like_their_grpc_twins(weights_server: ServeProcess, stubs: Stubs) -> None:
    url = weights_server.http_url
    status, body = call(url, "/pause?mode=keep", {})
    assert status == 200 and body["status"] == "paused" and body["was_paused"] is False
    state = stubs.state()
    assert state.paused and state.reason == upb.PAUSE_REASON_CALLER and state.mode == upb.PAUSE_MODE_KEEP
    assert call(url, "/is_paused") == (
        200,
        {"success": True, "status": "ok", "is_paused": True, "reason": "caller", "mode": "keep"},
    )

    status, body = call(url, "/resume", {})
    assert (status, body["status"], body["was_paused"]) == (200, "resumed", True)
    assert not stubs.state().paused
    assert call(url, "/is_paused")[1]["is_paused"] is False

    status, body = call(url, "/update_weight_version", {"new_version": "http-declared"})
    version = stubs.version()
    assert status == 200 and body["new_version"] == "http-declared"
    assert version.declared and version.version == "http-declared" and version.source == 1  # DECLARED
    assert body["weight_version"]["etag"] == version.etag and body["weight_version"]["revision"] == version.revision
    assert call(url, "/weight_info")[1]["weight_version"] == "http-declared"
    assert call(url, "/get_weight_version")[1]["weight_version"] == "http-declared"
    dynamo = call(url, "/engine/get_weight_version")[1]
    assert dynamo["version"] == "http-declared" and dynamo["version_declared"] is True
    assert call(url, "/get_world_size")[1]["world_size"] == 1
    assert call(url, "/get_server_info")[1]["weight_version"] == "http-declared"


def test_sglang_update_from_disk_loads_records_and_answers_when_done(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], tokens_b: list[int]
) -> None:
    url = weights_server.http_url
    status, body = call(
        url, "/update_weights_from_disk", {"model_path": str(checkpoints.b), "weight_version": "http-B"}
    )
    assert status == 200, body
    assert body["success"] is True and body["version"] == "http-B" and body["weight_version"]["source"] == "DISK"
    version = stubs.version()
    assert version.declared and version.version == "http-B" and version.source == 2  # DISK
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_b
    # Dynamo's name for the same route, back to A.
    status, body = call(
        url, "/engine/update_weights_from_disk", {"model_path": str(checkpoints.a), "weight_version": "A"}
    )
    assert status == 200 and body["version"] == "A"
    assert greedy_tokens(weights_server) == tokens_a


@pytest.mark.parametrize(
    ("path", "body", "raw", "http", "reason"),
    [
        ("/update_weights_from_disk", None, b"{not json", 400, "MALFORMED_REQUEST"),
        ("/update_weights_from_disk", None, b"[1, 2]", 400, "MALFORMED_REQUEST"),
        ("/update_weights_from_disk", {"weight_version": "x"}, None, 400, "MALFORMED_REQUEST"),
        ("/update_weights_from_disk", {"model_path": "/etc", "weight_version": "x"}, None, 403, "PATH_NOT_ALLOWED"),
        ("/update_weights_from_disk", {"model_path": "{b}", "load_format": "pt"}, None, 400, "LOAD_FORMAT_UNSUPPORTED"),
        ("/update_weights_from_disk", {"model_path": "{b}", "timeout": -1}, None, 400, "TIMEOUT_INVALID"),
        ("/update_weight_version", {"new_version": "x", "etag": "stale"}, None, 409, "ETAG_MISMATCH"),
        ("/update_weight_version", {"new_version": ""}, None, 400, "VERSION_REQUIRED"),
        ("/update_weight_version", {}, None, 400, "MALFORMED_REQUEST"),
        ("/pause_generation", {"mode": "sideways"}, None, 400, "PAUSE_MODE_INVALID"),
        ("/pause", {"mode": "wait", "timeout": 0}, None, 400, "TIMEOUT_INVALID"),
        (
            "/init_weights_update_group",
            {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
            None,
            412,
            "BACKEND_UNAVAILABLE",
        ),
        ("/update_weights_from_distributed", {"group_name": "nope", "names": "{tensor}"}, None, 404, "GROUP_NOT_FOUND"),
        (
            "/update_weights_from_distributed",
            {"group_name": "nope", "names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
            None,
            400,
            "TENSOR_MISMATCH",
        ),
        (
            "/update_weights_from_distributed",
            {"group_name": "g", "names": ["a"], "dtypes": ["complex7"], "shapes": [[1]]},
            None,
            400,
            "TENSOR_SPEC_INVALID",
        ),
        ("/destroy_weights_update_group", {"group_name": "nope"}, None, 404, "GROUP_NOT_FOUND"),
    ],
)
def test_refusals_answer_json_with_the_grpc_reason_and_change_nothing(
    weights_server: ServeProcess,
    stubs: Stubs,
    checkpoints: Checkpoints,
    tokens_a: list[int],
    path: str,
    body: dict[str, Any] | None,
    raw: bytes | None,
    http: int,
    reason: str,
) -> None:
    if body is not None and body.get("model_path") == "{b}":
        body = dict(body, model_path=str(checkpoints.b))
    if body is not None and body.get("names") == "{tensor}":  # one real tensor of the model
        name, tensor = next(iter(checkpoints.state_dict("A").items()))
        body = dict(body, names=[name], dtypes=["float32"], shapes=[list(tensor.shape)])
    before = stubs.version()
    status, answer = call(weights_server.http_url, path, body, raw=raw)
    assert (status, answer["error"]) == (http, reason), answer
    assert answer["success"] is False and answer["status"] == "error" and answer["message"]
    assert answer["details"]["code"] in {c.name for c in grpc.StatusCode}
    _unchanged(stubs, weights_server, before, tokens_a)


@pytest.fixture
def stalled_update(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> Iterator[str]:
    """An update holding the one update slot: a tensor stream whose sender stalls after its
    header (cancelled afterwards). Yields its Operation name."""
    state = checkpoints.state_dict("B")
    request_id = str(uuid.uuid4())
    header = upb.TensorStreamHeader(
        weight_version="stalled",
        request_id=request_id,
        tensors=[upb.TensorSpec(name=n, dtype=upb.TENSOR_DTYPE_FLOAT32, shape=list(t.shape)) for n, t in state.items()],
    )
    gate: queue.Queue[None] = queue.Queue()

    def messages() -> Iterator[upb.UpdateWeightsFromTensorsRequest]:
        yield upb.UpdateWeightsFromTensorsRequest(header=header)
        gate.get()

    stream = stubs.updates.UpdateWeightsFromTensors.future(messages())
    try:
        weights_server.wait_for_event(
            lambda e: e.get("event") == "weight update started" and e.get("request_id") == request_id
        )
        yield f"operations/{request_id}"
        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=f"operations/{request_id}"))
        with pytest.raises(grpc.RpcError):
            stream.result(timeout=60)
    finally:
        gate.put(None)


def test_an_update_in_progress_refuses_updates_and_resume_over_http(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], stalled_update: str
) -> None:
    url = weights_server.http_url
    before = stubs.version()
    status, body = call(url, "/update_weights_from_disk", {"model_path": str(checkpoints.b), "weight_version": "x"})
    assert (status, body["error"]) == (409, "UPDATE_IN_PROGRESS")
    assert body["details"]["operation"] == stalled_update
    # vLLM's /resume name cannot lift the pause an update holds (vLLM's own dev route did).
    status, body = call(url, "/resume", {})
    assert (status, body["error"]) == (409, "UPDATE_IN_PROGRESS")
    status, body = call(url, "/continue_generation", {})
    assert (status, body["error"]) == (409, "UPDATE_IN_PROGRESS")
    assert stubs.state().paused and stubs.state().update_operation == stalled_update
    assert call(url, "/is_paused")[1]["is_paused"] is True
    assert stubs.version() == before


def test_allow_vllm_dev_routes_keeps_vllms_weight_routes_and_enginectls_rl_names(
    weights_server: ServeProcess, stubs: Stubs, tokens_a: list[int]
) -> None:
    """The weights server runs with VLLM_SERVER_DEV_MODE=1 and --allow-vllm-dev-routes: vLLM's
    /collective_rpc answers as vLLM's (the drift test uses it), its /pause does not: that
    name is enginectl's PauseGeneration whatever the flag (the refusals without the flag are
    in test_smg_gateway.py)."""
    status, answer = call(weights_server.http_url, "/collective_rpc", {"method": "check_health"})
    assert status == 200 and "error" not in answer, answer
    status, answer = call(weights_server.http_url, "/pause?mode=keep", {})
    assert status == 200 and answer["status"] == "paused"
    assert stubs.state().reason == upb.PAUSE_REASON_CALLER  # enginectl's bookkeeping, not vLLM's
    call(weights_server.http_url, "/resume", {})
    assert not stubs.state().paused
    del tokens_a  # back_to_a (conftest) loads A afterwards


def test_a_grpc_pause_is_lifted_by_http_resume_and_both_agree(weights_server: ServeProcess, stubs: Stubs) -> None:
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    assert call(weights_server.http_url, "/is_paused")[1]["is_paused"] is True
    status, body = call(weights_server.http_url, "/engine/resume_generation", {})
    assert status == 200 and body["was_paused"] is True
    assert not stubs.state().paused


def test_flush_cache_liveness_and_server_info(weights_server: ServeProcess, stubs: Stubs) -> None:
    url = weights_server.http_url
    status, body = call(url, "/flush_cache", {})
    assert status == 200 and body["success"] is True
    assert call(url, "/engine/liveness_probe")[0] == 200
    status, info = call(url, "/get_server_info")
    version = stubs.version()
    assert status == 200 and info["incarnation"] == version.incarnation
    assert info["weight_version"] == version.version and info["is_paused"] is False


def test_vllm_engine_server_info_reports_enginectl_pause_and_uptime(weights_server: ServeProcess, stubs: Stubs) -> None:
    """What SMG reads of VllmEngine/GetServerInfo: is_paused and uptime from enginectl."""
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    engine = vllm_engine_pb2_grpc.VllmEngineStub(stubs.channel)
    assert engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest()).is_paused is False
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    try:
        info = engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
        assert info.is_paused is True and info.uptime_seconds > 0 and info.active_requests == 0
    finally:
        stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    assert engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest()).is_paused is False


def test_sglang_broadcast_routes_join_receive_and_destroy_a_gloo_group(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    """SGLang's three broadcast routes, with this test as the trainer (rank 0 over gloo): each
    route answers once its collective is done, as SGLang's do."""
    import concurrent.futures

    from enginectl.client.trainer_tensors import BroadcastGroup

    url = weights_server.http_url
    state = checkpoints.state_dict("B")
    group = BroadcastGroup.host("http-group", "gloo", "127.0.0.1", 0, 2, 60.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            joined = pool.submit(group.join)
            status, body = call(
                url,
                "/init_weights_update_group",
                {
                    "group_name": "http-group",
                    "master_address": "127.0.0.1",
                    "master_port": group.port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "backend": "gloo",
                },
            )
            assert status == 200, body
            joined.result(timeout=60)
            assert body["group"]["group_name"] == "http-group"

            request = {
                "group_name": "http-group",
                "names": list(state),
                "dtypes": ["float32"] * len(state),
                "shapes": [list(t.shape) for t in state.values()],
                "weight_version": "http-dist-B",
            }
            answered = pool.submit(call, url, "/update_weights_from_distributed", request)
            sent = group.broadcast([t.contiguous() for t in state.values()])
            status, body = answered.result(timeout=120)
            assert status == 200 and sent == len(state), body
            version = stubs.version()
            assert version.version == "http-dist-B" and version.source == 3  # DISTRIBUTED
            assert greedy_tokens(weights_server) == tokens_b
        finally:
            status, body = call(
                url, "/destroy_weights_update_group", {"group_name": "http-group", "allow_missing": True}
            )
            group.close()
    assert status == 200 and body["found"] is True
    status, body = call(url, "/destroy_weights_update_group", {"group_name": "http-group"})
    assert (status, body["error"]) == (404, "GROUP_NOT_FOUND")


@pytest.mark.parametrize("abort_all", [False, True])
def test_update_weight_version_never_aborts_unless_asked_as_sglang_does(
    weights_server: ServeProcess, stubs: Stubs, abort_all: bool
) -> None:
    """A request held by a KEEP pause: a declaration leaves it be; `abort_all_requests: true`
    (SGLang's default meaning, asked for) aborts it, and the caller's pause still holds."""
    import concurrent.futures
    import json
    import time
    import urllib.request

    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    body = {"model": weights_server.served_model, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{weights_server.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )

    def complete() -> str:
        with urllib.request.urlopen(request, timeout=120) as response:
            return str(json.load(response)["choices"][0]["finish_reason"])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        finished = pool.submit(complete)
        deadline = time.monotonic() + 60
        while stubs.state().num_waiting_requests + stubs.state().num_running_requests < 1:
            assert time.monotonic() < deadline, "the completion never reached the engine"
        answer = {"new_version": f"declared-{abort_all}", **({"abort_all_requests": True} if abort_all else {})}
        status, reply = call(weights_server.http_url, "/update_weight_version", answer)
        assert status == 200 and stubs.version().version == f"declared-{abort_all}", reply
        assert stubs.state().paused  # the caller's pause holds either way
        if abort_all:
            assert finished.result(timeout=60) == "abort"
        else:
            assert not finished.done()
            stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
            assert finished.result(timeout=60) == "length"
