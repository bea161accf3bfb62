"""data_parallel_size=2: a declaration and a weight update reach every EngineCore, not just
the first.

vLLM's own `set_weight_version_async` and `collective_rpc_async` go through
`call_utility_async`, which reaches only the first engine; rank 1 would keep the old label
(and the old weights).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.serving import ServeProcess, alive
from support.weights import Checkpoints, generate_on_rank

from e2e.own_servers import own_checkpoints
from enginectl.client import Client

pytestmark = pytest.mark.slow


checkpoints = own_checkpoints()


@pytest.fixture(scope="module")
def dp_server(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[ServeProcess]:
    srv = (
        ServeProcess(
            ["--data-parallel-size", "2", "--enable-scale-out", "--allow-weights-from", str(checkpoints.root)],
            serve_env,
        )
        .start()
        .wait_ready()
    )
    yield srv
    srv.kill()


def test_declared_version_stamps_outputs_of_both_ranks(dp_server: ServeProcess) -> None:
    assert dp_server.serving["dp_size"] == 2
    with Client(dp_server.grpc_target) as c:
        for version in ("dp-a", "dp-b"):
            c.set_weight_version(version)
            for rank in (0, 1):
                choice = generate_on_rank(dp_server, rank)
                n = len(choice["token_ids"])
                assert choice["weight_versions"] == [{"version": version, "start": 0, "end": n}], rank


def test_one_update_reaches_both_ranks(dp_server: ServeProcess, checkpoints: Checkpoints) -> None:
    import grpc
    from google.longrunning import operations_pb2, operations_pb2_grpc

    from enginectl.weights.v1 import weight_update_service_pb2 as upb
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc
    from enginectl.weights.v1 import weight_version_service_pb2 as vpb
    from enginectl.weights.v1 import weight_version_service_pb2_grpc as vpb_grpc

    channel = grpc.insecure_channel(dp_server.grpc_target)
    updates, ops = upb_grpc.WeightUpdateServiceStub(channel), operations_pb2_grpc.OperationsStub(channel)
    versions = vpb_grpc.WeightVersionServiceStub(channel)
    before = {rank: generate_on_rank(dp_server, rank)["token_ids"] for rank in (0, 1)}
    assert before[0] == before[1]  # both ranks serve checkpoint A

    op = updates.UpdateWeightsFromDisk(upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.b), weight_version="dp-B"))
    done = ops.WaitOperation(operations_pb2.WaitOperationRequest(name=op.name), timeout=120)
    response = upb.UpdateWeightsResponse()
    assert done.response.Unpack(response), done.error
    n = len(checkpoints.state_dict("B"))
    assert [(r.dp_rank, r.tensors_loaded) for r in response.ranks] == [(0, n), (1, n)]

    after = {rank: generate_on_rank(dp_server, rank) for rank in (0, 1)}
    assert after[0]["token_ids"] == after[1]["token_ids"] != before[0]
    for rank in (0, 1):
        assert after[rank]["weight_versions"][0]["version"] == "dp-B"
    verified = versions.VerifyWeights(vpb.VerifyWeightsRequest())
    assert verified.verdict == vpb.VERIFY_VERDICT_MATCH
    assert [(r.dp_rank, r.verdict) for r in verified.ranks] == [
        (0, vpb.VERIFY_VERDICT_MATCH),
        (1, vpb.VERIFY_VERDICT_MATCH),
    ]
    state = updates.GetGenerationState(upb.GetGenerationStateRequest()).state
    assert [r.dp_rank for r in state.ranks] == [0, 1] and not state.paused

    # Pause and resume reach both EngineCores (one round trip each, answering their states).
    paused = updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    assert not paused.was_paused and [(r.dp_rank, r.paused) for r in paused.state.ranks] == [(0, True), (1, True)]
    state = updates.GetGenerationState(upb.GetGenerationStateRequest()).state
    assert [(r.dp_rank, r.paused) for r in state.ranks] == [(0, True), (1, True)]
    resumed = updates.ResumeGeneration(upb.ResumeGenerationRequest())
    assert resumed.was_paused and [(r.dp_rank, r.paused) for r in resumed.state.ranks] == [(0, False), (1, False)]
    state = updates.GetGenerationState(upb.GetGenerationStateRequest()).state
    assert [(r.dp_rank, r.paused) for r in state.ranks] == [(0, False), (1, False)]
    channel.close()


def test_sigterm_stops_both_engine_cores(dp_server: ServeProcess) -> None:
    children = dp_server.descendants()
    assert sum("EngineCore" in " ".join(p.cmdline() + [p.name()]) for p in children) >= 2
    assert dp_server.terminate() == 0, dp_server.tail()
    assert not alive(children), [p.pid for p in alive(children)]
