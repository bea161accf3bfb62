"""A flooded FPM relay: its loop keeps serving control RPCs, and every stream is told exactly
what it did not get.

Real parts: the relay's own ZMQ SUB socket (FpmRelayHost) fed by a real ZMQ PUB, the real
gRPC server (ControlPlaneServer) on the test's loop with that relay behind
StreamForwardPassMetrics, and real gRPC clients. The publisher stands in for the EngineCores
only to flood faster than any relay relays: it queues a burst while the loop is blocked (so
more frames wait than the relay's intake backlog holds, and it must coalesce at intake),
then keeps publishing from a thread until a GetWeightVersion on the same server is answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from itertools import pairwise

import grpc
import pytest
import zmq
from support.fpm_helpers import HEARTBEAT, STEP, read_until, request

from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc
from enginectl.server.fpm.relay import FpmRelay, Subscription
from enginectl.server.fpm.relay_zmq import (
    COALESCE_BUDGET,
    DEFERRING_RELAY_BUDGET,
    PREPARE_SLICE,
    RELAY_BUDGET,
    FpmRelayHost,
)
from enginectl.server.fpm.samples import SampleFilter
from enginectl.server.grpc_server import ControlPlaneServer
from enginectl.server.prompt_calls import PromptCalls
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

WORKERS, RANKS = ("a", "b"), 2
BACKLOG = 2_048  # the relay's intake backlog here (INTAKE_BACKLOG in serve): reached at once
BURST = 30_000  # queued while the loop is blocked: the relay must coalesce at intake
MORE_AT_MOST = 100_000  # the thread's flood (at most 100,000 samples/s), ended by the answer


def sample(i: int) -> fpm_pb2.ForwardPassMetrics:
    """The i-th flood sample (counter_id i + 1): 2 workers x 2 ranks, every 5th a heartbeat."""
    return fpm_pb2.ForwardPassMetrics(
        schema_version=1,
        worker_id=WORKERS[i % 2],
        dp_rank=(i // 2) % RANKS,
        counter_id=i + 1,
        incarnation="flood",
        kind=HEARTBEAT if i % 5 == 0 else STEP,
        idle=i % 5 == 0,
    )


class Flood:
    """A real ZMQ PUB on the relay's endpoint (never drops: the loss, if any, is the relay's)."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(endpoint)
        self.sent = 0

    def send(self, count: int) -> None:
        for i in range(self.sent, self.sent + count):
            self.socket.send(sample(i).SerializeToString())
        self.sent += count

    def until(self, stop: threading.Event, at_most: int) -> bool:
        """Publish in chunks until `stop` is set (True) or `at_most` more were sent (False)."""
        end = self.sent + at_most
        while not stop.is_set():
            if self.sent >= end:
                return False
            self.send(min(500, end - self.sent))
            stop.wait(0.005)  # pacing the flood between chunks, not waiting for an outcome
        return True

    def close(self) -> None:
        self.socket.close(linger=1000)
        self._context.term()


class Hold:
    """A test-only unary RPC, /test.Hold/Hold, registered on the real server beside its own
    services: its handler answers once `release` is set, so a control call stays in flight
    as long as the test needs."""

    METHOD = "/test.Hold/Hold"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.call: asyncio.Task[object] | None = None  # the server's task for the last call

    async def hold(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.call = asyncio.current_task()
        self.entered.set()
        await self.release.wait()
        return b""

    async def ended(self) -> None:
        """Return once the server's task for the last call has ended (30 s at most): its
        done callbacks, the interceptor's among them, have run by then."""
        assert self.call is not None
        await asyncio.wait_for(asyncio.wait([self.call]), 30)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "test.Hold", {"Hold": grpc.unary_unary_rpc_method_handler(self.hold)}
        )


@pytest.fixture
async def hold() -> Hold:
    return Hold()


class Intake:
    """The relay host's `defer_to`, as serve wires it (the server's prompt-call count), with a
    hook a test may set to see each wakeup begin (it asks `defer_to` first)."""

    def __init__(self) -> None:
        self.prompt = PromptCalls()
        self.on_wakeup: Callable[[], None] | None = None

    def defer_to(self) -> bool:
        if self.on_wakeup is not None:
            self.on_wakeup()
        return self.prompt.any()


@pytest.fixture
async def intake() -> Intake:
    return Intake()


@pytest.fixture
async def flooded(hold: Hold, intake: Intake) -> AsyncIterator[tuple[FpmRelay, Flood, str]]:
    """A relay behind a real gRPC server on this loop (with the Hold RPC), and a connected
    flood publisher."""
    host = FpmRelayHost(ring_size=BURST + MORE_AT_MOST, intake_backlog=BACKLOG, defer_to=intake.defer_to)
    ledger = WeightVersionLedger()
    relay = host.start(ledger)
    plane = ControlPlaneServer(ledger, fpm_relay=relay, prompt_calls=intake.prompt)
    plane._server.add_generic_rpc_handlers((hold.handler(),))  # the test's RPC only
    port = await plane.start("127.0.0.1", 0)
    await plane.set_serving(True)
    flood = Flood(host.endpoint)
    try:
        await handshake(relay, flood)
        yield relay, flood, f"127.0.0.1:{port}"
    finally:
        flood.close()
        await plane.stop(1.0)
        await host.stop()


async def handshake(relay: FpmRelay, flood: Flood) -> None:
    """PUB drops frames until the relay's subscription reaches it: probe until one arrives."""
    probes = relay.subscribe(SampleFilter(worker_ids=frozenset({"probe"})))
    probe = fpm_pb2.ForwardPassMetrics(schema_version=1, worker_id="probe").SerializeToString()
    deadline = time.monotonic() + 30
    try:
        while not probes.take(1)[0]:
            assert time.monotonic() < deadline, "the relay never saw a probe"
            flood.socket.send(probe)
            await probes.wait(0.02)
    finally:
        probes.close()


def wanted(sample_filter: SampleFilter) -> Callable[[fpm_pb2.ForwardPassMetrics], bool]:
    def test(s: fpm_pb2.ForwardPassMetrics) -> bool:
        return (
            (sample_filter.include_heartbeats or s.kind != HEARTBEAT)
            and (sample_filter.worker_ids is None or s.worker_id in sample_filter.worker_ids)
            and (sample_filter.dp_ranks is None or s.dp_rank in sample_filter.dp_ranks)
        )

    return test


def drain(subscription: Subscription) -> list[int]:
    """The counter ids of everything a subscription has ready now, its replay included."""
    out = []
    while True:
        batch, _ = subscription.take(10_000)
        if not batch and subscription.live:
            return out
        out += [r.sample.counter_id for r in batch]


async def follow(
    call: grpc.aio.UnaryStreamCall, expected: asyncio.Future[int]
) -> tuple[list[fpm_pb2.ForwardPassMetrics], int]:
    """Read a stream all along, until it accounted for `expected` samples (once known):
    received, or counted in `missed`."""
    samples, missed, _ = await read_until(call, expected, timeout=120)
    return samples, missed


async def test_intake_works_through_a_backlog_in_bounded_wakeups(
    flooded: tuple[FpmRelay, Flood, str],
) -> None:
    """A burst queued while the loop was blocked is taken a bounded number of frames per
    wakeup, with the loop running other work in between; the part beyond a subscriber
    queue's depth is coalesced at intake, yet every sample is sequenced and kept."""
    relay, flood, _ = flooded
    head = relay.head
    flood_filter = SampleFilter(worker_ids=frozenset(WORKERS), include_heartbeats=True)
    reader = relay.subscribe(flood_filter)
    flood.send(BURST)  # blocks the loop: the burst waits in the relay's socket
    heads = [head]  # how far the relay got each time this task, sharing its loop, ran
    got = missed = 0
    deadline = time.monotonic() + 60
    while got + missed < BURST:
        assert time.monotonic() < deadline, f"got {got} + {missed} missed of {BURST} ({relay.stats})"
        await reader.wait(1.0)
        batch, m = reader.take(100_000)
        got, missed = got + len(batch), missed + m
        heads.append(relay.head)
    per_wakeup = RELAY_BUDGET + COALESCE_BUDGET
    assert all(b - a <= per_wakeup for a, b in pairwise(heads)), "a wakeup took more than its budget"
    assert len(set(heads)) > BURST // per_wakeup  # the loop ran this task between wakeups
    assert missed > 0 and relay.stats.coalesced_at_intake > 0
    assert drain(relay.subscribe(flood_filter, resume_after=head)) == list(range(1, BURST + 1))


async def test_a_wakeup_lets_the_loop_run_between_its_slices(
    flooded: tuple[FpmRelay, Flood, str], intake: Intake
) -> None:
    """A wakeup parses its frames a slice per loop turn and commits them after: a task on the
    same loop runs in between (so a control call's next step waits behind a slice, not a
    whole wakeup). Seen from a task that counts its own turns: a wakeup begins (the relay
    asks `defer_to`), the task runs several times, then the head moves."""
    relay, flood, _ = flooded
    turns = 0
    began: list[int] = []  # the task's turn count when each wakeup began

    def wakeup() -> None:
        began.append(turns)

    # A probe on the host's `defer_to` (which answers False: no call is in flight): nothing
    # else public marks the moment a wakeup begins.
    intake.on_wakeup = wakeup
    head, target = relay.head, relay.head + BURST
    moved: list[tuple[int, int]] = []  # (turn, frames committed since the last move)
    flood.send(BURST)  # blocks the loop: the burst waits in the relay's socket
    deadline = time.monotonic() + 60
    while relay.head < target:
        assert time.monotonic() < deadline, f"head {relay.head} of {target} ({relay.stats})"
        await asyncio.sleep(0)  # ok-sleep: exactly one loop turn; the test counts turns
        turns += 1
        if relay.head != head:
            moved.append((turns, relay.head - head))
            head = relay.head
    # For each move, the turns since the wakeup that committed it began.
    spreads = [(turn - max(b for b in began if b < turn), frames) for turn, frames in moved]
    turns_taken, frames = max(spreads, key=lambda spread: spread[1])
    assert frames > PREPARE_SLICE
    assert turns_taken >= frames // PREPARE_SLICE, f"{frames} frames parsed and committed in {turns_taken} turns"


async def heads_while(relay: FpmRelay, reader: Subscription, count: int) -> tuple[list[int], int]:
    """The relay's head each time this task (sharing its loop) ran, until `reader` accounted
    for `count` samples (received or missed); and how many it accounted for."""
    heads, taken = [relay.head], 0
    deadline = time.monotonic() + 60
    while taken < count:
        assert time.monotonic() < deadline, f"took {taken} ({relay.stats})"
        await reader.wait(1.0)
        batch, missed = reader.take(100_000)
        taken += len(batch) + missed
        heads.append(relay.head)
    return heads, taken


async def held(channel: grpc.aio.Channel, hold: Hold) -> grpc.aio.UnaryUnaryCall:
    """A Hold call, once its handler runs on the server."""
    hold.entered.clear()
    hold.release.clear()
    call = channel.unary_unary(Hold.METHOD)(b"", timeout=60)
    await asyncio.wait_for(hold.entered.wait(), 30)
    return call


async def test_intake_takes_small_bites_while_a_control_call_runs(
    flooded: tuple[FpmRelay, Flood, str], hold: Hold, intake: Intake
) -> None:
    """While a unary call is in flight on the server, each intake wakeup sequences at most
    the deferring budgets' worth of frames; once it is answered, the intake takes its full
    bites again. A cancelled call, a call past the prompt window and an open stream do not
    leave it deferring."""
    relay, flood, target = flooded
    flood_filter = SampleFilter(worker_ids=frozenset(WORKERS), include_heartbeats=True)
    reader = relay.subscribe(flood_filter)
    small = 2 * DEFERRING_RELAY_BUDGET  # relayed in full plus coalesced, per wakeup
    # The server's own prompt-call counter, with its window raised so a held call counts for as
    # long as a loaded machine takes to work through the burst, and set to zero below to see a
    # call outlive it without waiting. No stand-in: server, sockets and calls are real.
    intake.prompt.window_s = 60.0
    async with grpc.aio.insecure_channel(target) as channel:
        stream = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(request(["x"]))
        assert (await asyncio.wait_for(stream.read(), 30)).HasField("progress")
        assert not intake.prompt.any(), "an open stream made the intake defer"
        call = await held(channel, hold)
        assert intake.prompt.any()
        flood.send(BURST)  # blocks the loop: the burst waits in the relay's socket
        deferring, taken = await heads_while(relay, reader, BURST // 4)
        hold.release.set()
        assert await call == b""
        full, _ = await heads_while(relay, reader, BURST - taken)
        assert not intake.prompt.any()

        cancelled = await held(channel, hold)
        assert intake.prompt.any()
        cancelled.cancel()  # the server learns of it asynchronously
        await hold.ended()
        assert not intake.prompt.any(), "a cancelled call left the intake deferring"

        # A zero window lapses on the loop's next turn, before the call's handler runs.
        intake.prompt.window_s = 0.0
        long = await held(channel, hold)
        assert not intake.prompt.any(), "a call past the prompt window kept the intake deferring"
        hold.release.set()
        assert await long == b""
        stream.cancel()
    steps = [b - a for a, b in pairwise(deferring)]
    assert max(steps) <= small, f"a wakeup took {max(steps)} frames while a call was in flight"
    assert max(b - a for a, b in pairwise(full)) > small, "the intake stayed small after the call"


async def test_a_flooded_relay_answers_control_rpcs_and_tells_every_stream_what_it_missed(
    flooded: tuple[FpmRelay, Flood, str],
) -> None:
    """While the relay works through a burst and the flood goes on, GetWeightVersion on the
    same server is answered. Afterwards every stream (read all along, or only at the end)
    has, for each sample its filter wants, either received it or been told it missed it,
    in sequence order and ending with the newest sample of each worker and rank."""
    relay, flood, target = flooded
    filters = {
        "all": SampleFilter(worker_ids=frozenset(WORKERS), include_heartbeats=True),
        "steps": SampleFilter(worker_ids=frozenset(WORKERS)),
        "a1": SampleFilter(worker_ids=frozenset({"a"}), dp_ranks=frozenset({1})),
        "slow": SampleFilter(worker_ids=frozenset(WORKERS), include_heartbeats=True),
    }
    # The slow stream reads nothing until the flood is over; a small HTTP/2 window keeps the
    # server from parking the flood in transport buffers, so its queue coalesces as well.
    slow_options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * 1024)]
    async with (
        grpc.aio.insecure_channel(target) as channel,
        grpc.aio.insecure_channel(target, options=slow_options) as slow_channel,
    ):
        calls = {
            name: svc_grpc.ForwardPassMetricsServiceStub(
                slow_channel if name == "slow" else channel
            ).StreamForwardPassMetrics(
                request(sorted(f.worker_ids or ()), sorted(f.dp_ranks or ()), include_heartbeats=f.include_heartbeats)
            )
            for name, f in filters.items()
        }
        for call in calls.values():
            assert (await asyncio.wait_for(call.read(), 30)).HasField("progress")
        loop = asyncio.get_running_loop()
        expected = {name: loop.create_future() for name in filters}
        readers = {name: asyncio.create_task(follow(calls[name], expected[name])) for name in filters if name != "slow"}
        versions = wv_grpc.WeightVersionServiceStub(channel)
        idle = await versions.GetWeightVersion(wv_pb2.GetWeightVersionRequest(), timeout=30)

        flood.send(BURST)  # blocks the loop: the burst waits in the relay's socket
        answered = threading.Event()
        more = asyncio.create_task(asyncio.to_thread(flood.until, answered, MORE_AT_MOST))
        try:
            during = await versions.GetWeightVersion(wv_pb2.GetWeightVersionRequest(), timeout=60)
        finally:
            answered.set()
        assert await more, "the flood ended before GetWeightVersion was answered"
        assert during == idle

        published = [sample(i) for i in range(flood.sent)]
        for name, f in filters.items():
            expected[name].set_result(sum(map(wanted(f), published)))
        results = {name: await task for name, task in readers.items()}
        results["slow"] = await follow(calls["slow"], expected["slow"])
        for call in calls.values():
            call.cancel()
    assert relay.stats.coalesced_at_intake > 0
    for name, (samples, missed) in results.items():
        want = wanted(filters[name])
        assert len(samples) + missed == expected[name].result(), name
        assert all(map(want, samples)), name
        assert all(b.sequence > a.sequence for a, b in pairwise(samples)), name
        newest = {(s.worker_id, s.dp_rank): s.counter_id for s in published if want(s)}
        assert set(newest.values()) <= {s.counter_id for s in samples}, name
    assert results["slow"][1] > 0
