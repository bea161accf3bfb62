"""Pause and update edges that used to go wrong, each on this module's own `weights_server`:

- PauseGeneration with the mode unset keeps in-flight rollouts (KEEP), as its proto says;
- InitWeightsUpdateGroup refuses an impossible world size at once, before any rendezvous;
- a broadcast whose trainer never sends ends GROUP_TIMEOUT and destroys the group;
- a tensor stream's Operation progress follows what the worker loaded while the sender
  stalls (it used to stay at the first tensor).

Every test leaves the server serving checkpoint A, resumed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2
from support.serving import ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints

from e2e.own_servers import own_checkpoints, own_weights_server
from enginectl.client import TrainerClient
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

WAIT_S = 60.0
ROLLOUT_TOKENS = 64


checkpoints = own_checkpoints()
weights_server = own_weights_server()


def _seconds(value: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d


def wait_until(what: str, check: Any, timeout: float = WAIT_S) -> Any:
    """Poll `check()` (an RPC) until it returns something truthy, within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
    pytest.fail(f"{what}: not within {timeout}s")


@pytest.fixture(scope="module")
def stubs(weights_server: ServeProcess) -> Iterator[Stubs]:
    s = Stubs(weights_server)
    yield s
    s.channel.close()


@pytest.fixture(scope="module")
def client(weights_server: ServeProcess) -> Iterator[TrainerClient]:
    with TrainerClient(weights_server.grpc_target, timeout=120.0) as c:
        yield c


@pytest.fixture
def back_to_a(client: TrainerClient, checkpoints: Checkpoints) -> Iterator[None]:
    yield
    client.update_weights_from_disk(str(checkpoints.file("A")), "edges-A")
    if client.generation_state().paused:
        client.resume_generation(force=True)


def _generation(server: ServeProcess, out: dict[str, Any]) -> None:
    body = json.dumps(
        {
            "token_ids": [11, 12, 13, 14],
            "sampling_params": {"max_tokens": ROLLOUT_TOKENS, "temperature": 0.0, "ignore_eos": True},
        }
    ).encode()
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        out.update(json.load(response)["choices"][0])


def test_pause_without_a_mode_keeps_in_flight_requests(stubs: Stubs, weights_server: ServeProcess) -> None:
    """A rollout held by a first pause is in flight when a second PauseGeneration, mode
    unset, arrives: KEEP leaves it alone (ABORT would end it, waiting or running)."""
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP), timeout=30)
    out: dict[str, Any] = {}
    rollout = threading.Thread(target=_generation, args=(weights_server, out), daemon=True)
    try:
        rollout.start()
        wait_until("the rollout is queued", lambda: stubs.state().num_waiting_requests >= 1)
        again = stubs.updates.PauseGeneration(upb.PauseGenerationRequest(), timeout=30)  # mode unset
        assert again.was_paused and again.num_aborted_requests == 0
        assert again.state.mode == upb.PAUSE_MODE_KEEP
        assert stubs.state().num_waiting_requests >= 1  # still there, held
    finally:
        stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(), timeout=30)
    rollout.join(timeout=300)
    assert out.get("finish_reason") == "length", out.get("finish_reason")
    assert len(out["token_ids"]) == ROLLOUT_TOKENS


def test_impossible_world_size_is_refused_before_any_rendezvous(stubs: Stubs) -> None:
    before = stubs.versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version
    request = upb.InitWeightsUpdateGroupRequest(
        group_name="huge",
        master_address="127.0.0.1",
        master_port=1,
        rank_offset=1,
        world_size=100_000,
        backend=upb.GROUP_BACKEND_GLOO,
        timeout=_seconds(30),
    )
    with pytest.raises(grpc.RpcError) as err:
        stubs.updates.InitWeightsUpdateGroup(request, timeout=3)  # a rendezvous would outlast this
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(err.value).reason == "GROUP_SIZE_INVALID"
    assert stubs.versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version == before


def _spec(name: str, tensor: Any) -> upb.TensorSpec:
    return upb.TensorSpec(name=name, dtype=upb.TENSOR_DTYPE_FLOAT32, shape=list(tensor.shape))


def test_broadcast_that_never_comes_times_out_and_destroys_the_group(
    stubs: Stubs,
    client: TrainerClient,
    checkpoints: Checkpoints,
    back_to_a: None,
) -> None:
    before = stubs.versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version
    name, tensor = next(iter(checkpoints.state_dict("B").items()))
    group = client.init_weights_update_group("silent-trainer", timeout=30.0)
    try:
        op = stubs.updates.UpdateWeightsFromDistributed(
            upb.UpdateWeightsFromDistributedRequest(
                group_name=group.group_name,
                tensors=[_spec(name, tensor)],
                weight_version="never",
                timeout=_seconds(2.0),
            ),
            timeout=30,
        )
        done = stubs.ops.WaitOperation(
            operations_pb2.WaitOperationRequest(name=op.name, timeout=_seconds(WAIT_S)), timeout=WAIT_S + 5
        )
        assert done.done and done.WhichOneof("result") == "error", done
        assert done.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        with pytest.raises(grpc.RpcError) as err:
            stubs.updates.DestroyWeightsUpdateGroup(
                upb.DestroyWeightsUpdateGroupRequest(group_name=group.group_name), timeout=30
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # a timed-out collective is not reused
        assert error_info(err.value).reason == "GROUP_NOT_FOUND"
    finally:
        client.destroy_weights_update_group(group.group_name, allow_missing=True)
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=done.error.code, message=done.error.message, details=list(done.error.details))
    reasons = [
        error_details_pb2.ErrorInfo.FromString(d.value).reason
        for d in status.details
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)
    ]
    assert reasons == ["GROUP_TIMEOUT"], status
    assert stubs.versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version == before
    assert not stubs.state().paused  # nothing was written: the update resumed generation


def test_stream_progress_follows_the_loaded_tensors_while_the_sender_stalls(
    stubs: Stubs,
    checkpoints: Checkpoints,
    back_to_a: None,
) -> None:
    tensors = list(checkpoints.state_dict("B").items())
    first = 6  # tensors sent before the sender stalls
    header = upb.TensorStreamHeader(
        tensors=[_spec(n, t) for n, t in tensors], weight_version="stalled", timeout=_seconds(120)
    )
    payload = b"".join(t.contiguous().numpy().tobytes() for _, t in tensors[:first])
    release = threading.Event()

    def messages() -> Iterator[upb.UpdateWeightsFromTensorsRequest]:
        yield upb.UpdateWeightsFromTensorsRequest(header=header)
        for offset in range(0, len(payload), 1 << 20):
            chunk = payload[offset : offset + (1 << 20)]
            yield upb.UpdateWeightsFromTensorsRequest(chunk=upb.TensorStreamChunk(offset=offset, data=chunk))
        release.wait(WAIT_S)  # the sender stalls, the stream stays open

    call = stubs.updates.UpdateWeightsFromTensors.future(messages(), timeout=WAIT_S * 2)
    try:

        def progressed() -> operations_pb2.Operation | None:
            ops = stubs.ops.ListOperations(operations_pb2.ListOperationsRequest(name="operations"), timeout=30)
            for op in ops.operations:
                meta = upb.UpdateWeightsMetadata()
                op.metadata.Unpack(meta)
                if not op.done and meta.weight_version == "stalled" and meta.tensors_done >= first:
                    return op
            return None

        op = wait_until("progress reaches the tensors sent", progressed, timeout=20)
        meta = upb.UpdateWeightsMetadata()
        op.metadata.Unpack(meta)
        assert meta.tensors_done == first and meta.weights_modified
        assert meta.bytes_done == len(payload)
        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=30)
    finally:
        release.set()
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert error_info(err.value).reason == "PARTIAL_UPDATE"
