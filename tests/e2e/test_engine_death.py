"""Engine death is never hidden: a real `enginectl serve` whose EngineCore is SIGKILLed.

The moment vLLM's engine dies, gRPC health turns NOT_SERVING, open WatchWeightVersion and
StreamForwardPassMetrics streams end with UNAVAILABLE `ENGINE_DEAD`, a read waiting on the
engine answers `ENGINE_DEAD` instead of hanging (vLLM leaves such a call pending for ever),
later reads claim no version for weights that no longer exist, and the process shuts down
and exits non-zero within `ENGINE_DEAD_EXIT_BOUND_S`, leaving no child behind (the worker the
killed EngineCore leaves orphaned included), so a supervisor restarts it.

The test kills a real EngineCore; tests/unit/test_engine_death.py drives the same switch
(`ControlPlaneServer.engine_dead`) on an in-process server with no engine, to show that
every RPC of every service is refused while health and reflection stay open.

Every wait has a deadline: streams are read with gRPC deadlines, the exit with `wait(timeout)`.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.serving import ServeProcess, alive

from enginectl.client.errors import Reason, from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.server.serve import ENGINE_DEAD_EXIT_BOUND_S, ENGINE_DEAD_EXIT_CODE
from enginectl.weights.v1 import weight_update_service_pb2 as wu_pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as wu_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

VERSION = "policy-7"
# From the kill to NOT_SERVING and to the streams' end: the death is noticed at once (an
# event, not a poll); the margin is for a loaded 2-core machine.
NOTICE_BOUND_S = 10.0
# Deadline of every stream opened before the kill (longer than the whole test needs).
STREAM_DEADLINE_S = ENGINE_DEAD_EXIT_BOUND_S + 60.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def doomed(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    """A server of this test's own: it is killed."""
    srv = ServeProcess(["--worker-id", "w"], serve_env).start().wait_ready()
    yield srv
    srv.kill()


def _engine_core(srv: ServeProcess) -> psutil.Process:
    for proc in srv.descendants():
        try:
            if "EngineCore" in proc.name() + " " + " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    pytest.fail(f"no EngineCore among {[p.pid for p in srv.descendants()]}")


def _stream_error(stream: grpc.Call) -> grpc.RpcError:
    """Read `stream` to its end (bounded by its deadline); the error it ended with."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as err:
        return err
    pytest.fail("the stream ended OK; it must end with an error")


def test_engine_core_killed_ends_streams_refuses_reads_and_exits_non_zero(doomed: ServeProcess) -> None:
    srv = doomed
    channel = grpc.insecure_channel(srv.grpc_target)
    versions = wv_grpc.WeightVersionServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    declared = versions.SetWeightVersion(wv_pb2.SetWeightVersionRequest(version=VERSION), timeout=60)
    assert declared.weight_version.version == VERSION

    watch = versions.WatchWeightVersion(wv_pb2.WatchWeightVersionRequest(), timeout=STREAM_DEADLINE_S)
    assert next(watch).weight_version.version == VERSION  # live: the current state came
    fpm = fpm_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(
        fpm_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True), timeout=STREAM_DEADLINE_S
    )
    assert next(fpm).HasField("progress")  # live: the first message is a progress
    health_watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=NOTICE_BOUND_S + 20)
    assert next(health_watch).status == SERVING

    children = srv.descendants()
    core = _engine_core(srv)
    # A read that waits on the engine, in flight when it dies: the EngineCore is stopped
    # first, so GetGenerationState's utility call has no answer. The GetWeightVersion after
    # it, on the same connection, is answered only once the server has the first request.
    core.send_signal(signal.SIGSTOP)
    in_flight = wu_grpc.WeightUpdateServiceStub(channel).GetGenerationState.future(
        wu_pb2.GetGenerationStateRequest(), timeout=STREAM_DEADLINE_S
    )
    assert versions.GetWeightVersion(wv_pb2.GetWeightVersionRequest(), timeout=60).weight_version.version == VERSION
    assert not in_flight.done()
    killed = time.monotonic()
    core.send_signal(signal.SIGKILL)

    # 1. Health turns NOT_SERVING (a deadline-bounded stream, so today's code fails here).
    for answer in health_watch:
        if answer.status == NOT_SERVING:
            break
    noticed = time.monotonic() - killed
    assert noticed < NOTICE_BOUND_S, noticed

    # 2. Both streams ended UNAVAILABLE ENGINE_DEAD (not SHUTTING_DOWN), and so did the read
    # that was waiting on the engine.
    for stream in (watch, fpm):
        err = from_rpc_error(_stream_error(stream))
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD), err
    in_flight_error = in_flight.exception()
    assert in_flight_error is not None, in_flight.result()
    err = from_rpc_error(in_flight_error)
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD), err
    assert time.monotonic() - killed < NOTICE_BOUND_S

    # 3. A read claims no version. It races the server's stop: the answer is UNAVAILABLE
    # ENGINE_DEAD while the gRPC server is up, or, with no reason, UNAVAILABLE once it is gone
    # or CANCELLED when the call met the stop; never the declared version.
    try:
        answer = versions.GetWeightVersion(wv_pb2.GetWeightVersionRequest(), timeout=30)
        pytest.fail(f"GetWeightVersion answered after the engine died: {answer}")
    except grpc.RpcError as rpc_err:
        err = from_rpc_error(rpc_err)
        refused = (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD)
        gone = err.reason == "" and err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert refused or gone, err
    channel.close()

    # 4. The process exits non-zero within the bound, and no child is left.
    assert srv.proc is not None
    try:
        code = srv.proc.wait(max(ENGINE_DEAD_EXIT_BOUND_S - (time.monotonic() - killed), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {ENGINE_DEAD_EXIT_BOUND_S}s after the engine died:\n{srv.tail(200)}")
    assert code == ENGINE_DEAD_EXIT_CODE != 0, srv.tail()
    assert not alive(children), [p.pid for p in alive(children)]
    srv.exited.wait(30)
    events = srv.events()
    dead = [e for e in events if e.get("event") == "engine_dead"]
    assert dead and "EngineCore" in dead[0]["cause"], srv.tail()
    assert [e["exit_code"] for e in events if e.get("event") == "stopped"] == [ENGINE_DEAD_EXIT_CODE]
