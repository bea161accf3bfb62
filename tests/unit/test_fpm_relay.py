"""FpmRelay: sequencing, identity gating, ring, resume and slow-subscriber coalescing.

The pure core is driven directly (its rules are plain logic); the fan-in tests feed it
through its real ZMQ SUB socket (FpmRelayHost) from a real ZMQ PUB publishing real
ForwardPassMetrics frames from another thread: a real part standing in for the EngineCore
publishers, so rates and counts are under the test's control.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import AsyncIterator
from itertools import pairwise

import grpc
import pytest
import zmq

from enginectl.client import Reason
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.server.errors import ControlPlaneError
from enginectl.server.fpm.relay import FpmRelay, RelayClosed, Subscription
from enginectl.server.fpm.relay_zmq import FpmRelayHost
from enginectl.server.fpm.samples import SampleFilter
from enginectl.server.fpm.services.stream import encode_batch
from enginectl.server.weights.version.ledger import WeightVersionLedger

STEP, HEARTBEAT = fpm_pb2.SAMPLE_KIND_STEP, fpm_pb2.SAMPLE_KIND_HEARTBEAT


def frame(worker_id: str = "w", dp_rank: int = 0, counter_id: int = 1, kind: int = STEP) -> bytes:
    return fpm_pb2.ForwardPassMetrics(
        schema_version=1,
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=counter_id,
        incarnation="test",
        kind=kind,
        idle=kind == HEARTBEAT,
    ).SerializeToString()


def drain(sub: Subscription, max_size: int = 10_000) -> tuple[list[fpm_pb2.ForwardPassMetrics], int]:
    """Everything the subscription has ready now (replay included), and the missed total."""
    out, missed = [], 0
    while True:
        batch, m = sub.take(max_size)
        missed += m
        if not batch and sub.live:
            return out, missed
        out.extend(r.sample for r in batch)


def test_sequences_count_from_one_and_weight_revision_is_stamped() -> None:
    revision = [0]
    relay = FpmRelay(incarnation="inc", revision=lambda: revision[0])
    sub = relay.subscribe(SampleFilter(include_heartbeats=True))
    relay.accept(frame(counter_id=1))
    revision[0] = 3
    relay.accept(frame(counter_id=2, kind=HEARTBEAT))
    got, missed = drain(sub)
    assert [(s.sequence, s.weight_revision, s.counter_id) for s in got] == [(1, 0, 1), (2, 3, 2)]
    assert missed == 0 and relay.head == 2 and relay.oldest == 1


def test_batches_are_encoded_as_protobuf_would_encode_them() -> None:
    """The shared pre-encoded wire form (publisher frame + appended stamps) parses to the
    stamped message, and a batch of them to the response protobuf itself would build."""
    relay = FpmRelay(incarnation="inc", revision=lambda: 300)
    sub = relay.subscribe(SampleFilter())
    for i in range(3):
        relay.accept(frame(counter_id=i + 1))
    relay.ring.head += 1_000_000  # a multi-byte varint sequence
    relay.accept(frame(counter_id=4))
    batch, _ = sub.take(10)
    wire = encode_batch(batch, missed=129)
    expected = svc_pb2.StreamForwardPassMetricsResponse(
        batch=svc_pb2.ForwardPassMetricsBatch(samples=[r.sample for r in batch], missed=129)
    )
    assert svc_pb2.StreamForwardPassMetricsResponse.FromString(wire) == expected
    assert [s.sequence for s in expected.batch.samples] == [1, 2, 3, 1_000_004]
    assert {s.weight_revision for s in expected.batch.samples} == {300}


def test_required_identity_drops_and_counts_empty_worker_ids() -> None:
    relay = FpmRelay(incarnation="inc", require_identity=True)
    sub = relay.subscribe(SampleFilter(include_heartbeats=True))
    relay.accept(frame(worker_id=""))
    relay.accept(frame(worker_id="", kind=HEARTBEAT))
    relay.accept(frame(worker_id="w"))
    got, _ = drain(sub)
    assert [(s.worker_id, s.sequence) for s in got] == [("w", 1)]
    assert relay.stats.dropped_unattributed == 2 and relay.stats.accepted == 1


def test_without_required_identity_empty_worker_ids_flow() -> None:
    relay = FpmRelay(incarnation="inc")
    sub = relay.subscribe(SampleFilter())
    relay.accept(frame(worker_id=""))
    assert [s.worker_id for s in drain(sub)[0]] == [""]


def test_malformed_frames_are_counted_not_relayed() -> None:
    relay = FpmRelay(incarnation="inc")
    relay.accept(b"\xff\xff\xff")
    relay.accept(fpm_pb2.ForwardPassMetrics(worker_id="w").SerializeToString())  # schema_version 0
    assert relay.head == 0 and relay.stats.dropped_malformed == 2


def test_filters_select_workers_ranks_and_heartbeats() -> None:
    relay = FpmRelay(incarnation="inc")
    only_a1 = relay.subscribe(SampleFilter(worker_ids=frozenset({"a"}), dp_ranks=frozenset({1})))
    everything = relay.subscribe(SampleFilter(include_heartbeats=True))
    for worker in ("a", "b"):
        for rank in (0, 1):
            relay.accept(frame(worker, rank))
            relay.accept(frame(worker, rank, kind=HEARTBEAT))
    assert [(s.worker_id, s.dp_rank, s.kind) for s in drain(only_a1)[0]] == [("a", 1, STEP)]
    assert len(drain(everything)[0]) == 8


def test_resume_replays_every_kept_sample_once_then_goes_live() -> None:
    relay = FpmRelay(incarnation="inc", ring_size=100)
    for i in range(1, 51):
        relay.accept(frame(counter_id=i))
    sub = relay.subscribe(SampleFilter(), resume_after=20)
    first = [r.sample for r in sub.take(10)[0]]
    assert [s.sequence for s in first] == list(range(21, 31))
    relay.accept(frame(counter_id=51))  # arrives mid-replay: read from the ring, not queued
    rest, missed = drain(sub)
    assert [s.sequence for s in first + rest] == list(range(21, 52)) and missed == 0
    assert sub.live
    relay.accept(frame(counter_id=52))
    assert [s.sequence for s in drain(sub)[0]] == [52]


def test_resume_at_head_is_live_and_zero_means_from_the_first() -> None:
    relay = FpmRelay(incarnation="inc")
    assert relay.subscribe(SampleFilter(), resume_after=0).live  # empty ring, nothing to replay
    relay.accept(frame())
    assert relay.subscribe(SampleFilter(), resume_after=1).live
    assert [s.sequence for s in drain(relay.subscribe(SampleFilter(), resume_after=0))[0]] == [1]


def test_evicted_resume_point_is_out_of_range_with_the_oldest_kept() -> None:
    relay = FpmRelay(incarnation="inc", ring_size=10)
    for i in range(25):
        relay.accept(frame(counter_id=i + 1))
    assert (relay.oldest, relay.head) == (16, 25)
    relay.subscribe(SampleFilter(), resume_after=15)  # 16 is kept: fine
    with pytest.raises(ControlPlaneError) as err:
        relay.subscribe(SampleFilter(), resume_after=14)
    assert err.value.code is grpc.StatusCode.OUT_OF_RANGE
    assert err.value.reason == Reason.SEQUENCE_EVICTED
    assert err.value.metadata == {"oldest_sequence": "16", "head_sequence": "25", "incarnation": "inc"}


def test_resume_in_the_future_is_out_of_range() -> None:
    relay = FpmRelay(incarnation="inc")
    relay.accept(frame())
    with pytest.raises(ControlPlaneError) as err:
        relay.subscribe(SampleFilter(), resume_after=2)
    assert err.value.reason == Reason.SEQUENCE_IN_FUTURE
    assert err.value.metadata["head_sequence"] == "1"


def test_a_replay_that_falls_off_the_ring_fails_instead_of_skipping() -> None:
    relay = FpmRelay(incarnation="inc", ring_size=10)
    for _ in range(10):
        relay.accept(frame())
    sub = relay.subscribe(SampleFilter(), resume_after=0)
    assert [r.sample.sequence for r in sub.take(3)[0]] == [1, 2, 3]
    for _ in range(5):
        relay.accept(frame())  # evicts 4 and 5 before the replay reads them
    with pytest.raises(ControlPlaneError) as err:
        sub.take(3)
    assert err.value.reason == Reason.SEQUENCE_EVICTED


def test_slow_subscriber_coalesces_to_latest_per_worker_rank_and_counts_missed() -> None:
    relay = FpmRelay(incarnation="inc", queue_limit=8)
    slow = relay.subscribe(SampleFilter())
    fast = relay.subscribe(SampleFilter())
    fast_got: list[fpm_pb2.ForwardPassMetrics] = []
    for i in range(100):
        relay.accept(frame(f"w{i % 2}", (i // 2) % 2, counter_id=i + 1))
        fast_got.extend(drain(fast)[0])
    got, missed = drain(slow)
    assert [s.sequence for s in fast_got] == list(range(1, 101))
    assert len(got) + missed == 100 and missed > 0
    assert relay.stats.subscriber_missed == missed and slow.missed_total == missed
    # The latest sample of each (worker_id, dp_rank) survives.
    latest = {(s.worker_id, s.dp_rank): s.sequence for s in fast_got}
    assert set(latest.values()) <= {s.sequence for s in got}
    assert [s.sequence for s in got] == sorted(s.sequence for s in got)


def test_missed_is_reported_on_the_next_batch_only() -> None:
    relay = FpmRelay(incarnation="inc", queue_limit=4)
    sub = relay.subscribe(SampleFilter())
    for _ in range(6):
        relay.accept(frame())
    batch, missed = sub.take(100)
    assert missed > 0 and len(batch) + missed == 6
    relay.accept(frame())
    assert sub.take(100)[1] == 0


def test_a_batch_is_offered_as_if_its_samples_came_one_at_a_time() -> None:
    """Fan-out is per batch (relay.py), yet every queue ends up exactly as if the samples had
    come one by one: same samples kept, same coalescing points, same missed counts."""
    stream = [frame(f"w{i % 3}", i % 2, counter_id=i + 1) for i in range(480)]
    one, many = FpmRelay(incarnation="inc", queue_limit=16), FpmRelay(incarnation="inc", queue_limit=16)
    wanted = SampleFilter(worker_ids=frozenset({"w0", "w1"}))
    one_subs = [one.subscribe(wanted), one.subscribe(SampleFilter())]
    many_subs = [many.subscribe(wanted), many.subscribe(SampleFilter())]
    for i, f in enumerate(stream):
        one.accept(f)
        if i % 40 == 39:  # a slow reader takes a little now and then
            one_subs[0].take(5)
    for start in range(0, len(stream), 40):
        many.accept_many(stream[start : start + 40])
        many_subs[0].take(5)
    for a, b in zip(one_subs, many_subs, strict=True):
        got_a, missed_a = drain(a)
        got_b, missed_b = drain(b)
        assert [s.sequence for s in got_a] == [s.sequence for s in got_b] and missed_a == missed_b
        assert a.missed_total == b.missed_total > 0
    assert one.stats.coalesced_at_intake == many.stats.coalesced_at_intake == 0


def test_coalescing_at_intake_keeps_every_sample_and_tells_each_filter_what_it_skipped() -> None:
    """A batch accepted while the intake is behind: every sample is sequenced and kept (a
    resume replays them all), each live subscription gets the latest sample per (worker_id,
    dp_rank) and kind that its filter wants, and is told exactly how many others it wanted."""
    relay = FpmRelay(incarnation="inc")
    filters = {
        "all": SampleFilter(include_heartbeats=True),
        "steps": SampleFilter(),
        "a1": SampleFilter(worker_ids=frozenset({"a"}), dp_ranks=frozenset({1})),
        "b-beats": SampleFilter(worker_ids=frozenset({"b"}), include_heartbeats=True),
        "nobody": SampleFilter(worker_ids=frozenset({"nobody"})),
    }
    subs = {name: relay.subscribe(f) for name, f in filters.items()}
    published = [
        fpm_pb2.ForwardPassMetrics.FromString(
            frame(("a", "b")[i % 2], (i // 2) % 2, counter_id=i + 1, kind=HEARTBEAT if i % 7 == 0 else STEP)
        )
        for i in range(400)
    ]
    assert relay.accept_many([p.SerializeToString() for p in published], coalesce=True) == 400
    assert relay.head == 400
    for name, sub in subs.items():
        got, missed = drain(sub)
        wanted = [p for p in published if _wanted_by(filters[name], p)]
        assert len(got) + missed == len(wanted), name
        latest = {(p.worker_id, p.dp_rank, p.kind): p.counter_id for p in wanted}
        assert sorted(s.counter_id for s in got) == sorted(latest.values()), name
        assert [s.sequence for s in got] == sorted(s.sequence for s in got)
    assert relay.stats.coalesced_at_intake == 400 - 8  # 2 workers x 2 ranks x 2 kinds kept
    replay = relay.subscribe(SampleFilter(include_heartbeats=True), resume_after=0)
    assert [s.counter_id for s in drain(replay)[0]] == list(range(1, 401))


def _wanted_by(f: SampleFilter, sample: fpm_pb2.ForwardPassMetrics) -> bool:
    return (
        (f.include_heartbeats or sample.kind != HEARTBEAT)
        and (f.worker_ids is None or sample.worker_id in f.worker_ids)
        and (f.dp_ranks is None or sample.dp_rank in f.dp_ranks)
    )


async def test_close_ends_waiting_subscriptions() -> None:
    relay = FpmRelay(incarnation="inc")
    sub = relay.subscribe(SampleFilter())
    waiter = asyncio.create_task(sub.wait(30))
    await asyncio.sleep(0)  # ok-sleep: one yield (no time passes) so the waiter is waiting
    relay.close()
    assert await asyncio.wait_for(waiter, 5)
    with pytest.raises(RelayClosed):
        sub.take(10)
    with pytest.raises(RelayClosed):
        relay.subscribe(SampleFilter())


# -- through the real ZMQ socket --------------------------------------------------------------


class Publisher:
    """A real ZMQ PUB on its own thread, connected to the relay's endpoint."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop in the test publisher
        self.socket.connect(endpoint)

    def connect_handshake(self, seen: threading.Event, timeout: float = 10.0) -> None:
        """PUB drops frames until the SUB's subscription arrives: send probes until one is seen."""
        deadline = time.monotonic() + timeout
        while not seen.wait(0.01):
            assert time.monotonic() < deadline, "relay never saw a probe"
            self.socket.send(frame("probe"))

    def close(self) -> None:
        self.socket.close(linger=1000)
        self._context.term()


@pytest.fixture
async def host() -> AsyncIterator[FpmRelayHost]:
    host = FpmRelayHost(ring_size=50_000)
    yield host
    await host.stop()


async def test_endpoint_is_private_ipc_and_removed_on_stop() -> None:
    host = FpmRelayHost()
    path = host.endpoint.removeprefix("ipc://")
    assert host.endpoint.startswith("ipc://") and os.path.exists(path)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    await host.stop()
    assert not os.path.exists(os.path.dirname(path))


async def test_zmq_fan_in_slow_subscriber_misses_fast_one_does_not(host: FpmRelayHost) -> None:
    """A real PUB sends 20,000 samples from 4 (worker, rank) pairs through the relay's real
    SUB socket, in chunks of 2,000 that each wait for the fast subscriber to have read the
    previous one (the relay is never more than a chunk behind); the fast subscriber gets
    every one in order; a slow one that reads nothing until the end gets the latest per key
    and is told how many it missed."""
    ledger = WeightVersionLedger()
    relay = host.start(ledger)
    probe_seen = threading.Event()
    probe = relay.subscribe(SampleFilter(worker_ids=frozenset({"probe"})))
    publisher = Publisher(host.endpoint)
    try:
        waiter = asyncio.create_task(probe.wait(10))
        await asyncio.to_thread(publisher.connect_handshake, _set_when(waiter, probe_seen))
        probe.close()
        wanted = SampleFilter(worker_ids=frozenset({"w0", "w1"}))
        fast, slow = relay.subscribe(wanted), relay.subscribe(wanted)
        total, chunk = 20_000, 2_000
        frames = [frame(f"w{i % 2}", (i // 2) % 2, counter_id=i + 1) for i in range(total)]
        read = threading.Semaphore(0)  # one release per chunk the fast subscriber has read

        def publish() -> None:
            for start in range(0, total, chunk):
                for f in frames[start : start + chunk]:
                    publisher.socket.send(f)
                assert read.acquire(timeout=60), "the fast subscriber stopped reading"

        sender = asyncio.create_task(asyncio.to_thread(publish))
        got, fast_missed, chunks_read = [], 0, 0
        deadline = time.monotonic() + 60
        while len(got) + fast_missed < total:
            assert time.monotonic() < deadline, f"fast subscriber got {len(got)} of {total} ({relay.stats})"
            await fast.wait(1.0)
            batch, missed = fast.take(1000)
            got.extend(r.sample for r in batch)
            fast_missed += missed
            while len(got) + fast_missed >= (chunks_read + 1) * chunk:
                chunks_read += 1
                read.release()
            await asyncio.sleep(0)  # ok-sleep: one yield (no time passes), like a real writer
        await sender
        slow_got, slow_missed = drain(slow)
    finally:
        publisher.close()
    assert fast_missed == 0 and relay.stats.coalesced_at_intake == 0
    assert [s.counter_id for s in got] == list(range(1, total + 1))
    sequences = [s.sequence for s in got]
    assert all(b > a for a, b in pairwise(sequences))
    assert slow_missed > 0 and len(slow_got) + slow_missed == total
    assert {s.counter_id for s in got[-4:]} <= {s.counter_id for s in slow_got}


def _set_when(task: asyncio.Task[bool], event: threading.Event) -> threading.Event:
    task.add_done_callback(lambda t: event.set())
    return event
