"""Planner consumer against a fleet of two real `enginectl serve` processes.

Server A starts with `--worker-id planner-a`. Server B starts without a worker id (its identity
is assigned after the engine started), so its EngineCore publishes under "": the planner must report
WORKER_COUNT_MISMATCH and count B's unattributed samples, then OK once SetWorkerIdentity
gave B its id, then STALE once B is terminated. Both servers send heartbeats every 0.2 s, so
a live rank is always fresh. The resume test breaks the planner's connection for real with
a TCP proxy it talks through (fpm_helpers.CuttableProxy), then points that proxy at another
server (the session's) to show that a restart is seen as one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from google.protobuf import duration_pb2
from support.fpm_helpers import CuttableProxy, RelayPublisher, frames, relay_endpoint, request
from support.serving import ServeProcess, alive

from enginectl.client import Planner, PlannerThread, Reason, Verdict
from enginectl.client.errors import from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc

HEARTBEAT_FLAGS = ["--fpm-heartbeat-interval", "0.2"]
STALE_AFTER_S = 3.0
WORKERS = {"planner-a", "planner-b"}


@pytest.fixture(scope="module")
def fleet(serve_env: dict[str, str]) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    a = ServeProcess(["--worker-id", "planner-a", *HEARTBEAT_FLAGS], serve_env).start()
    b = ServeProcess(HEARTBEAT_FLAGS, serve_env).start()
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        for srv in (a, b):
            try:
                if srv.proc is not None and srv.proc.poll() is None:
                    srv.terminate()
            finally:
                srv.kill()


@pytest.fixture
async def planner(fleet: tuple[ServeProcess, ServeProcess]) -> AsyncIterator[Planner]:
    a, b = fleet
    async with Planner([a.grpc_target, b.grpc_target], stale_after=STALE_AFTER_S) as p:
        yield p


def verdict_is(verdict: Verdict, workers: set[str] = WORKERS, dp_size: int = 1):  # type: ignore[no-untyped-def]
    return lambda p: p.reconcile(workers, dp_size).verdict is verdict


async def test_planner_sees_unattributed_then_ok_after_identity_sync_then_stale(
    fleet: tuple[ServeProcess, ServeProcess], planner: Planner
) -> None:
    a, b = fleet
    # 1. B publishes under "": one expected worker is missing, and B's samples are counted.
    assert await planner.wait_for(
        lambda p: (
            verdict_is(Verdict.WORKER_COUNT_MISMATCH)(p)
            and p.reconcile(WORKERS, 1).unattributed.get(b.grpc_target, 0) > 0
        ),
        60,
    ), planner.reconcile(WORKERS, 1)
    mismatch = planner.reconcile(WORKERS, 1)
    assert mismatch.workers == {"planner-a": (0,)}
    assert mismatch.unattributed[a.grpc_target] == 0
    assert [(r.endpoint, r.worker_id, r.dp_rank) for r in mismatch.unattributed_ranks] == [(b.grpc_target, "", 0)]
    assert "planner-b" in mismatch.detail

    # 2. The identity sync gives B its id on every rank: the fleet reconciles.
    async with grpc.aio.insecure_channel(b.grpc_target) as channel:
        ack = await id_grpc.FpmIdentityServiceStub(channel).SetWorkerIdentity(
            id_pb2.SetWorkerIdentityRequest(worker_id="planner-b", timeout=duration_pb2.Duration(seconds=30)),
            timeout=60,
        )
    assert [r.worker_id for r in ack.ranks] == ["planner-b"]
    assert await planner.wait_for(verdict_is(Verdict.OK), 30), planner.reconcile(WORKERS, 1)
    ok = planner.reconcile(WORKERS, 1)
    assert ok.workers == {"planner-a": (0,), "planner-b": (0,)} and not ok.unattributed_ranks
    assert ok.unattributed[b.grpc_target] >= mismatch.unattributed[b.grpc_target]  # history is kept

    # 3. B stops publishing (terminated): its stream ends with UNAVAILABLE at once, and after
    #    the staleness window the planner says STALE, naming B.
    async with grpc.aio.insecure_channel(b.grpc_target) as channel:
        stream = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(request())
        await stream.read()
        children = b.descendants()
        stopping = asyncio.create_task(asyncio.to_thread(b.terminate))
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                await asyncio.wait_for(stream.read(), 30)
        assert planner.reconcile(WORKERS, 1).ok  # B just went quiet: not stale before the window
        err = from_rpc_error(ended.value)
        assert err.code is grpc.StatusCode.UNAVAILABLE and err.reason == Reason.SHUTTING_DOWN
        assert time.monotonic() - t0 < 10
        assert await stopping == 0
    assert alive(children) == []
    assert await planner.wait_for(verdict_is(Verdict.STALE), STALE_AFTER_S + 30), planner.reconcile(WORKERS, 1)
    stale = planner.reconcile(WORKERS, 1)
    assert [(r.endpoint, r.worker_id) for r in stale.stale] == [(b.grpc_target, "planner-b")]
    assert not planner.status[b.grpc_target].connected
    assert planner.status[a.grpc_target].connected


async def test_planner_resumes_after_a_broken_connection_without_loss_or_duplicates(
    fleet: tuple[ServeProcess, ServeProcess],
    server: ServeProcess,
) -> None:
    """Then sees a restart: `server` (the session's) stands in for A restarted."""
    a, _ = fleet
    other = server
    proxy = CuttableProxy(a.grpc_target)
    through = await proxy.start()
    publisher = RelayPublisher(relay_endpoint(a))
    await publisher.connect(a.grpc_target)
    w, n = f"resume-{uuid.uuid4().hex[:6]}", 600
    try:
        async with Planner([through], backoff_initial=0.05, backoff_max=0.5) as planner:
            status = planner.status[through]

            def count(p: Planner) -> int:
                return p.fleet.sample_counts(through).get(w, 0)

            assert await planner.wait_for(lambda p: status.connected, 30)
            await asyncio.to_thread(publisher.send_all, frames(w, n // 3))
            assert await planner.wait_for(lambda p: count(p) == n // 3, 30)
            proxy.cut(block=True)  # the path breaks; samples keep coming meanwhile
            assert await planner.wait_for(lambda p: not status.connected, 30)
            await asyncio.to_thread(publisher.send_all, frames(w, n - n // 3, start=n // 3 + 1))
            proxy.blocked = False
            assert await planner.wait_for(lambda p: count(p) >= n, 30), count(planner)
            # Settle: heartbeats keep flowing, so anything duplicated would have arrived too.
            seq = planner.status[through].last_sequence or 0
            assert await planner.wait_for(lambda p: (p.status[through].last_sequence or 0) > seq, 30)
            assert count(planner) == n  # every sample once: none lost, none duplicated
            assert status.reconnects >= 1 and status.restarts == 0 and status.missed == 0
            assert status.resyncs == 0  # resumed, not re-synced

            # The same address now leads to another server (a restart, as the planner sees
            # it): the resume is refused with INCARNATION_CHANGED, the old samples are
            # forgotten and the stream starts live on the new incarnation.
            proxy.upstream = other.grpc_target
            proxy.cut()
            assert await planner.wait_for(
                lambda p: status.incarnation == other.serving["incarnation"] and status.connected, 60
            )
            assert status.restarts == 1 and status.resyncs == 1
            assert status.last_error is not None and status.last_error.reason == Reason.INCARNATION_CHANGED
            assert all(r.worker_id != "planner-a" for r in planner.fleet.latest())
    finally:
        publisher.close()
        await proxy.close()


def test_planner_thread_serves_blocking_callers(fleet: tuple[ServeProcess, ServeProcess]) -> None:
    a, _ = fleet
    with PlannerThread([a.grpc_target], stale_after=STALE_AFTER_S) as planner:
        assert planner.wait_for(verdict_is(Verdict.OK, {"planner-a"}), 60)
        verdict = planner.reconcile({"planner-a"}, dp_size=1)
        assert verdict.ok and verdict.workers == {"planner-a": (0,)}
        assert planner.reconcile({"planner-a"}, dp_size=2).verdict is Verdict.INCOMPLETE_COVERAGE
        assert planner.reconcile({"nobody"}, dp_size=1).verdict is Verdict.NO_FPM_DATA
