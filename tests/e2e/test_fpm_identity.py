"""Worker identity on every rank: cold start (`--worker-id`), late start (`--await-worker-id`,
data_parallel_size=2), bad input, and failed syncs that must take the server down.

Real `enginectl serve` processes; samples are read from the real gRPC
StreamForwardPassMetrics (the relay in front of every rank's publisher). Each module-scoped
server's tests run in file order.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from support.fpm_helpers import SampleStream
from support.serving import READY_TIMEOUT_S, ServeProcess, alive

from enginectl.client.errors import EnginectlError, Reason, from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc

STEP, HEARTBEAT = fpm_pb2.SAMPLE_KIND_STEP, fpm_pb2.SAMPLE_KIND_HEARTBEAT
IDENTITY_SERVICE = "enginectl.fpm.v1.FpmIdentityService"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
WAIT_S = 120.0


# -- helpers ----------------------------------------------------------------------------------
def has(samples: list[fpm_pb2.ForwardPassMetrics], rank: int, kind: int, worker_id: str, generation: int) -> bool:
    return any(
        (s.dp_rank, s.kind, s.worker_id, s.identity_generation) == (rank, kind, worker_id, generation) for s in samples
    )


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def identity_stub(channel: grpc.Channel) -> id_grpc.FpmIdentityServiceStub:
    return id_grpc.FpmIdentityServiceStub(channel)


def set_identity(
    target: str, worker_id: str, timeout: duration_pb2.Duration | None = None
) -> id_pb2.SetWorkerIdentityResponse:
    with grpc.insecure_channel(target) as channel:
        request = id_pb2.SetWorkerIdentityRequest(worker_id=worker_id, timeout=timeout)
        return identity_stub(channel).SetWorkerIdentity(request, timeout=120)


def get_identity(target: str, timeout: duration_pb2.Duration | None = None) -> id_pb2.GetWorkerIdentityResponse:
    with grpc.insecure_channel(target) as channel:
        return identity_stub(channel).GetWorkerIdentity(id_pb2.GetWorkerIdentityRequest(timeout=timeout), timeout=60)


def ranks(response: id_pb2.SetWorkerIdentityResponse | id_pb2.GetWorkerIdentityResponse) -> list[tuple[int, str, int]]:
    return [(r.dp_rank, r.worker_id, r.identity_generation) for r in response.ranks]


def seconds(value: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromTimedelta(timedelta(seconds=value))
    return duration


def sync_failure(err: grpc.RpcError) -> id_pb2.IdentitySyncFailure:
    status = rpc_status.from_call(err)
    assert status is not None
    for detail in status.details:
        if detail.Is(id_pb2.IdentitySyncFailure.DESCRIPTOR):
            failure = id_pb2.IdentitySyncFailure()
            detail.Unpack(failure)
            return failure
    raise AssertionError("no IdentitySyncFailure in the status details")


def generate(server_http: str, model: str, rank: int | None = None) -> None:
    """A short completion; with `rank`, pinned to that DP rank (needs --enable-scale-out)."""
    if rank is None:
        url, body = "/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": 4}
        headers = {"content-type": "application/json"}
    else:
        url = "/inference/v1/generate"
        body = {"token_ids": [1, 43, 375, 82], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
        headers = {"content-type": "application/json", "X-data-parallel-rank": str(rank)}
    request = urllib.request.Request(server_http + url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200


def awaiting(srv: ServeProcess) -> dict:
    """Wait for `awaiting_worker_id` (the ports are in it)."""
    return srv.wait_for_event(lambda e: e.get("event") == "awaiting_worker_id", timeout=READY_TIMEOUT_S)


def exits_nonzero_without_children(srv: ServeProcess, children: list) -> None:
    assert srv.proc is not None
    code = srv.proc.wait(120)
    assert code != 0, srv.tail()
    srv.exited.wait(30)
    assert not alive(children), [p.pid for p in alive(children)]
    assert [e for e in srv.events() if e.get("event") == "stopped"][-1]["exit_code"] == 1


# -- cold start: --worker-id ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cold(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    srv = ServeProcess(["--worker-id", "w-cold", "--fpm-heartbeat-interval", "0.25"], serve_env).start().wait_ready()
    yield srv
    try:
        assert srv.terminate() == 0
    finally:
        srv.kill()


def test_cold_start_every_sample_carries_the_worker_id_from_the_first(cold: ServeProcess) -> None:
    stream = SampleStream(cold.grpc_target)
    try:
        generate(cold.http_url, cold.served_model)
        stream.wait_for(lambda s: has(s, 0, STEP, "w-cold", 1) and sum(x.kind == HEARTBEAT for x in s) >= 3)
        samples = list(stream.samples)
    finally:
        stream.close()
    # Replayed from the incarnation's first sample: counter 1 is the first the rank made.
    assert (samples[0].sequence, samples[0].counter_id) == (1, 1)
    assert all((s.worker_id, s.identity_generation) == ("w-cold", 1) for s in samples)
    assert all(s.incarnation == cold.serving["incarnation"] for s in samples)
    steps = [s for s in samples if s.kind == STEP]
    assert sum(s.scheduled.num_prefill_requests for s in steps) >= 1 and all(s.wall_time > 0 for s in steps)
    assert [s.counter_id for s in samples] == list(range(1, len(samples) + 1))  # none lost
    # No identity RPC was needed (every mutating RPC is logged).
    assert not [e for e in cold.events() if e.get("event") == "rpc" and "Identity" in str(e.get("rpc"))]
    answer = get_identity(cold.grpc_target)
    assert ranks(answer) == [(0, "w-cold", 1)] and answer.consistent and not answer.await_worker_id


@pytest.mark.parametrize(
    ("worker_id", "timeout", "reason"),
    [
        ("", None, Reason.WORKER_ID_REQUIRED),
        ("x" * 257, None, Reason.WORKER_ID_TOO_LONG),
        ("é" * 129, None, Reason.WORKER_ID_TOO_LONG),  # 258 bytes of UTF-8
        ("bad\nid", None, Reason.WORKER_ID_INVALID),
        ("ok", 0.0, Reason.TIMEOUT_INVALID),
        ("ok", -1.0, Reason.TIMEOUT_INVALID),
        ("ok", 301.0, Reason.TIMEOUT_INVALID),
    ],
)
def test_bad_set_worker_identity_is_invalid_argument_and_changes_nothing(
    cold: ServeProcess, worker_id: str, timeout: float | None, reason: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        set_identity(cold.grpc_target, worker_id, None if timeout is None else seconds(timeout))
    err: EnginectlError = from_rpc_error(caught.value)
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    assert err.field_violations and err.field_violations[0].field in ("worker_id", "timeout")
    assert ranks(get_identity(cold.grpc_target)) == [(0, "w-cold", 1)]
    assert health(cold.grpc_target) == SERVING


def test_bad_get_worker_identity_timeout_is_invalid_argument(cold: ServeProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        get_identity(cold.grpc_target, seconds(0.0))
    assert from_rpc_error(caught.value).reason == Reason.TIMEOUT_INVALID


def test_setting_the_held_identity_is_a_safe_retry_and_a_new_one_bumps_the_generation(cold: ServeProcess) -> None:
    assert ranks(set_identity(cold.grpc_target, "w-cold")) == [(0, "w-cold", 1)]
    stream = SampleStream(cold.grpc_target)
    try:
        assert ranks(set_identity(cold.grpc_target, "w-cold-2")) == [(0, "w-cold-2", 2)]
        generate(cold.http_url, cold.served_model)
        stream.wait_for(lambda s: has(s, 0, STEP, "w-cold-2", 2) and has(s, 0, HEARTBEAT, "w-cold-2", 2))
        after = [s for s in stream.samples if s.identity_generation == 2]
        assert after and all(s.worker_id == "w-cold-2" for s in after)
    finally:
        stream.close()
    assert health(cold.grpc_target) == SERVING


# -- late start, data_parallel_size=2: --await-worker-id -------------------------------------
@pytest.fixture(scope="module")
def late(serve_env: dict[str, str]) -> Iterator[tuple[ServeProcess, str, str]]:
    srv = ServeProcess(
        ["--data-parallel-size", "2", "--await-worker-id", "--enable-scale-out", "--fpm-heartbeat-interval", "0.5"],
        serve_env,
    ).start()
    event = awaiting(srv)
    yield srv, f"127.0.0.1:{event['grpc_port']}", f"http://127.0.0.1:{event['http_port']}"
    srv.kill()


@pytest.fixture(scope="module")
def late_stream(late: tuple[ServeProcess, str, str]) -> Iterator[SampleStream]:
    stream = SampleStream(late[1])
    yield stream
    stream.close()


@pytest.mark.slow
def test_late_start_is_not_serving_and_no_unattributed_sample_leaves(
    late: tuple[ServeProcess, str, str], late_stream: SampleStream
) -> None:
    srv, target, http = late
    assert health(target) == NOT_SERVING
    assert health(target, IDENTITY_SERVICE) == NOT_SERVING
    answer = get_identity(target)
    assert ranks(answer) == [(0, "", 0), (1, "", 0)]
    assert answer.await_worker_id and not answer.consistent
    for rank in (0, 1):  # both ranks step (and heartbeat) under the empty identity
        generate(http, "", rank)
    seen = late_stream.progress
    # A progress message comes only after a quiet interval: all those samples reached the relay.
    late_stream.wait_for(lambda s: late_stream.progress > seen)
    assert late_stream.samples == []
    assert not [e for e in srv.events() if e.get("event") == "serving"]


@pytest.mark.slow
def test_set_worker_identity_acks_both_ranks_then_both_publish_it_and_serve(
    late: tuple[ServeProcess, str, str], late_stream: SampleStream
) -> None:
    srv, target, http = late
    assert ranks(set_identity(target, "w-late", seconds(60))) == [(0, "w-late", 1), (1, "w-late", 1)]
    srv.wait_for_event(lambda e: e.get("event") == "serving", timeout=60)
    assert health(target) == SERVING and health(target, IDENTITY_SERVICE) == SERVING
    for rank in (0, 1):
        generate(http, "", rank)
    late_stream.wait_for(
        lambda s: all(has(s, rank, kind, "w-late", 1) for rank in (0, 1) for kind in (STEP, HEARTBEAT))
    )
    assert all(s.worker_id == "w-late" for s in late_stream.samples)
    # Everything the relay kept since the start, replayed: not one sample without the id.
    kept = len(late_stream.samples)
    replay = SampleStream(target)
    try:
        replay.wait_for(lambda s: len(s) >= kept)
        assert all(s.worker_id for s in replay.samples)
    finally:
        replay.close()
    answer = get_identity(target)
    assert answer.consistent and answer.await_worker_id


@pytest.mark.slow
def test_identity_change_reaches_heartbeats_of_both_ranks(
    late: tuple[ServeProcess, str, str], late_stream: SampleStream
) -> None:
    _, target, _ = late
    assert ranks(set_identity(target, "w-late-2")) == [(0, "w-late-2", 2), (1, "w-late-2", 2)]
    late_stream.wait_for(lambda s: has(s, 0, HEARTBEAT, "w-late-2", 2) and has(s, 1, HEARTBEAT, "w-late-2", 2))
    assert ranks(get_identity(target)) == [(0, "w-late-2", 2), (1, "w-late-2", 2)]


@pytest.mark.slow
def test_a_deadline_no_rank_can_meet_is_fatal_in_await_mode(late: tuple[ServeProcess, str, str]) -> None:
    srv, target, _ = late
    children = srv.descendants()
    assert len(children) >= 2
    with pytest.raises(grpc.RpcError) as caught:
        set_identity(target, "w-late-3", duration_pb2.Duration(nanos=1))
    err = from_rpc_error(caught.value)
    assert (err.code, err.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.IDENTITY_SYNC_FAILED)
    assert err.metadata["failed_ranks"] == "0,1" and err.metadata["acked_ranks"] == ""
    failure = sync_failure(caught.value)
    assert [(f.dp_rank, f.reason) for f in failure.failed] == [(0, "RANK_TIMEOUT"), (1, "RANK_TIMEOUT")]
    exits_nonzero_without_children(srv, children)


# -- await mode with a scheduler that has no identity: the sync fails, the server exits -------
def test_failed_sync_in_await_mode_exits_nonzero_never_serving(serve_env: dict[str, str]) -> None:
    srv = ServeProcess(
        ["--await-worker-id", "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"], serve_env
    ).start()
    try:
        event = awaiting(srv)
        target = f"127.0.0.1:{event['grpc_port']}"
        assert health(target) == NOT_SERVING
        children = srv.descendants()
        with pytest.raises(grpc.RpcError) as caught:
            set_identity(target, "w-x", seconds(30))
        err = from_rpc_error(caught.value)
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, Reason.IDENTITY_SYNC_FAILED)
        assert err.metadata["failed_ranks"] == "0"
        assert [(f.dp_rank, f.reason) for f in sync_failure(caught.value).failed] == [(0, "RANK_ERROR")]
        exits_nonzero_without_children(srv, children)
        assert not [e for e in srv.events() if e.get("event") == "serving"], "reported serving"
    finally:
        srv.kill()


def test_failed_sync_with_retry_policy_keeps_waiting_not_serving(serve_env: dict[str, str]) -> None:
    """`--identity-sync-failure retry`: the failure is reported, the server stays up and
    NOT_SERVING for another attempt, and a read names the rank that cannot answer."""
    srv = ServeProcess(
        [
            "--await-worker-id",
            "--identity-sync-failure",
            "retry",
            "--scheduler-cls",
            "vllm.v1.core.sched.scheduler.Scheduler",
        ],
        serve_env,
    ).start()
    try:
        target = f"127.0.0.1:{awaiting(srv)['grpc_port']}"
        children = srv.descendants()
        for _ in range(2):  # a retry is accepted (and fails the same way)
            with pytest.raises(grpc.RpcError) as caught:
                set_identity(target, "w-x", seconds(30))
            assert from_rpc_error(caught.value).reason == Reason.IDENTITY_SYNC_FAILED
        with pytest.raises(grpc.RpcError) as caught:
            get_identity(target)
        err = from_rpc_error(caught.value)
        assert (err.code, err.reason, err.metadata["failed_ranks"]) == (
            grpc.StatusCode.UNAVAILABLE,
            Reason.IDENTITY_READ_FAILED,
            "0",
        )
        assert health(target) == NOT_SERVING
        assert srv.terminate() == 0, srv.tail()
        assert not alive(children), [p.pid for p in alive(children)]
        assert not [e for e in srv.events() if e.get("event") == "serving"]
    finally:
        srv.kill()
