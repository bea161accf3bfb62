"""The EngineCore FPM publisher on a real engine: the session's idle engine sends idle
heartbeats at the interval, read over gRPC. Its timing rule, drop counting and identity are
checked in this process in tests/unit/test_fpm_publisher.py.
"""

from __future__ import annotations

import grpc
from support.serving import ServeProcess

from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc

HEARTBEAT = fpm_pb2.SAMPLE_KIND_HEARTBEAT


def test_idle_engine_sends_idle_heartbeats_at_the_interval(server: ServeProcess) -> None:
    """The session server runs with the default 1 s interval and no load between tests. Only
    its engine's samples count (other tests may feed the relay from their own publisher)."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = svc_grpc.ForwardPassMetricsServiceStub(channel)
        call = stub.StreamForwardPassMetrics(
            svc_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True), timeout=60
        )
        beats: list[fpm_pb2.ForwardPassMetrics] = []
        try:
            for message in call:
                beats.extend(
                    s
                    for s in message.batch.samples
                    if s.kind == HEARTBEAT and s.incarnation == server.serving["incarnation"]
                )
                if len(beats) >= 4:
                    break
        finally:
            call.cancel()
    assert all(b.idle and b.num_running == 0 and b.num_waiting == 0 for b in beats)
    assert all(b.dp_rank == 0 for b in beats)
    counters = [b.counter_id for b in beats]
    assert counters == list(range(counters[0], counters[0] + 4))  # nothing else was made in between
    gaps = [
        (b.emit_time.ToNanoseconds() - a.emit_time.ToNanoseconds()) / 1e9
        for a, b in zip(beats, beats[1:], strict=False)
    ]
    # Never before the interval; the upper bound only guards against a stalled timer.
    assert all(0.95 <= gap < 5.0 for gap in gaps), gaps
