"""A forced resume lets generation run over mixed weights, but never reports SERVING.

docs/operations.md, "Quarantine": no engine is SERVING while undeclared after a partial failure. A partial update
(a tensor stream cancelled after tensors were written) quarantines the server: gRPC health
NOT_SERVING and vLLM's VllmEngine/HealthCheck unhealthy (the only check the SMG gateway makes).
`ResumeGeneration(force=true)` is the operator's choice to generate anyway: completions come
again, yet both health checks stay down until an update succeeds (docs/operations.md,
"Quarantine"); then both turn healthy.
"""

from __future__ import annotations

import grpc
from google.longrunning import operations_pb2
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from support.fault_helpers import (
    HEALTH_SERVICES,
    NOT_SERVING,
    SERVING,
    WRITTEN_BYTES,
    Stubs,
    assert_partial,
    generated,
    health,
    stalled_stream,
)
from support.serving import ServeProcess
from support.weights import Checkpoints

from enginectl.weights.v1 import weight_update_service_pb2 as upb


def engine_health(channel: grpc.Channel) -> vllm_engine_pb2.HealthCheckResponse:
    """vLLM's own health check on the control port, as a gateway asks it."""
    return vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=30)


def test_a_forced_resume_generates_but_stays_quarantined_until_an_update_succeeds(
    weights_server: ServeProcess, checkpoints: Checkpoints
) -> None:
    stubs = Stubs(weights_server)
    try:
        stubs.load(checkpoints.a, "A")
        assert engine_health(stubs.channel).healthy
        child, name = stalled_stream(weights_server, stubs, checkpoints.file("B"), WRITTEN_BYTES)
        with child:
            stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=name), timeout=30)
            op = stubs.finished(name)
        assert_partial(stubs, op, "UPDATE_CANCELLED")  # NOT_SERVING, held paused
        answer = engine_health(stubs.channel)
        assert not answer.healthy and "quarantined" in answer.message, answer

        resumed = stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=30)
        assert resumed.was_paused and not resumed.state.paused
        for _ in range(3):  # generation runs, over weights nobody can name ...
            assert len(generated(weights_server, 8)) == 8
            # ... and neither health check takes the engine for serving them.
            assert health(stubs) == {service: NOT_SERVING for service in HEALTH_SERVICES}
            assert not engine_health(stubs.channel).healthy
        version = stubs.version()
        assert not version.declared and version.last_failure.reason == "PARTIAL_UPDATE", version
        # A plain resume now is no error (nothing is paused), and lifts nothing either.
        stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(), timeout=30)
        assert health(stubs) == {service: NOT_SERVING for service in HEALTH_SERVICES}

        stubs.load(checkpoints.a, "A")  # a successful update ends the quarantine
        assert health(stubs) == {service: SERVING for service in HEALTH_SERVICES}
        assert engine_health(stubs.channel).healthy
        assert stubs.version().version == "A"
    finally:
        stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=30)
        stubs.load(checkpoints.a, "A")
        stubs.close()
