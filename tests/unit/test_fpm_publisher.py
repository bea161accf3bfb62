"""The EngineCore FPM publisher: heartbeat timing rule, drop counting, one identity for both
paths.

The timing rule is tested in its pure core (HeartbeatTimer) with a fake clock, and the
publisher with a real ZMQ SUB socket in this process (no engine needed for what it does with
samples). Idle heartbeats of a real engine are read in tests/e2e/test_fpm_publisher.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.worker.fpm.identity import IdentityError, WorkerIdentity
from enginectl.worker.fpm.load import QueuedLoad, ScheduledLoad, queued_load, scheduled_load
from enginectl.worker.fpm.publisher import FpmPublisher, PublisherConfig
from enginectl.worker.fpm.timing import HeartbeatTimer

STEP, HEARTBEAT = fpm_pb2.SAMPLE_KIND_STEP, fpm_pb2.SAMPLE_KIND_HEARTBEAT


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- HeartbeatTimer: the pure timing rule ----------------------------------------------------
IDLE = (0, 0, 0)  # (steps in flight, running, waiting)


def test_idle_rank_owes_an_idle_heartbeat_every_interval() -> None:
    clock = FakeClock()
    timer = HeartbeatTimer(1.0, clock)
    clock.now += 0.999
    assert timer.poll(*IDLE) is None
    assert timer.seconds_until_due() == pytest.approx(0.001)
    clock.now += 0.001
    assert timer.poll(*IDLE) is True
    timer.sample_made()
    clock.now += 0.5
    assert timer.poll(*IDLE) is None
    clock.now += 0.5
    assert timer.poll(*IDLE) is True


def test_a_step_sample_postpones_the_heartbeat() -> None:
    clock = FakeClock()
    timer = HeartbeatTimer(1.0, clock)
    clock.now += 0.9
    timer.sample_made()  # a step's sample
    clock.now += 0.9
    assert timer.poll(*IDLE) is None
    clock.now += 0.1
    assert timer.poll(*IDLE) is True


def test_a_step_longer_than_the_interval_yields_busy_heartbeats_never_idle() -> None:
    clock = FakeClock()
    timer = HeartbeatTimer(1.0, clock)
    for _ in range(3):  # 3 s inside one step: one busy heartbeat per second
        clock.now += 1.0
        # Even if the request counts momentarily read 0, a step in flight is not idle.
        assert timer.poll(1, 0, 0) is False
        timer.sample_made()
    clock.now += 1.0
    assert timer.poll(*IDLE) is True  # the step ended and nothing is left


def test_requests_running_or_waiting_make_a_busy_heartbeat() -> None:
    clock = FakeClock()
    timer = HeartbeatTimer(0.5, clock)
    clock.now += 0.5
    assert timer.poll(0, 1, 0) is False  # e.g. generation paused with requests kept
    assert timer.poll(0, 0, 3) is False
    assert timer.poll(*IDLE) is True


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HeartbeatTimer(0.0)


# -- request metrics from scheduler state (pure) ----------------------------------------------
def _request(prompt: int, computed: int, output: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        num_prompt_tokens=prompt, num_computed_tokens=computed, num_output_tokens=output, num_tokens=prompt + output
    )


def test_scheduled_load_splits_prefill_chunks_prefix_hits_and_decodes() -> None:
    # As read right after schedule(): num_computed_tokens already includes this step's tokens.
    requests = {
        "new": _request(prompt=10, computed=10),  # whole prompt, no cache hit
        "cached": _request(prompt=20, computed=20),  # 12 cached + 8 computed now
        "chunk": _request(prompt=100, computed=64),  # second chunk: 32 earlier + 32 now
        "dec1": _request(prompt=5, computed=9, output=4),  # decoding, context 9
        "dec2": _request(prompt=5, computed=13, output=8),  # decoding, context 13
    }
    load = scheduled_load({"new": 10, "cached": 8, "chunk": 32, "dec1": 1, "dec2": 1}, requests)
    assert load.num_prefill_requests == 3
    assert load.sum_prefill_tokens == 10 + 8 + 32
    assert load.sum_prefill_kv_tokens == 0 + 12 + 32
    assert load.var_prefill_length == pytest.approx(statistics.pvariance([10, 20, 100]))
    assert (load.num_decode_requests, load.sum_decode_kv_tokens, load.var_decode_kv_tokens) == (2, 22, 4.0)
    assert scheduled_load({"new": 10}, requests).var_prefill_length == 0.0  # fewer than two


def test_queued_load_counts_new_and_preempted_requests_across_queues() -> None:
    waiting = [_request(prompt=4, computed=0), _request(prompt=8, computed=0)]
    held = [_request(prompt=6, computed=0, output=3)]  # preempted after generating: context 9
    load = queued_load(waiting, held)
    assert (load.num_prefill_requests, load.sum_prefill_tokens, load.var_prefill_length) == (2, 12, 4.0)
    assert (load.num_decode_requests, load.sum_decode_kv_tokens, load.var_decode_kv_tokens) == (1, 9, 0.0)
    assert queued_load([], []) == QueuedLoad()


# -- FpmPublisher with a real ZMQ SUB ---------------------------------------------------------
@pytest.fixture
def sub(tmp_path: Path) -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    endpoint = f"ipc://{tmp_path}/fpm.sock"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close(linger=0)
    ctx.term()


def _recv(sock: zmq.Socket) -> fpm_pb2.ForwardPassMetrics:
    msg = fpm_pb2.ForwardPassMetrics()
    msg.ParseFromString(sock.recv())
    return msg


def _step(publisher: FpmPublisher, **load: int) -> None:
    publisher.step_finished(0.01, ScheduledLoad(**load), QueuedLoad(num_prefill_requests=2), 0.25, 1, 2)


def _publisher(
    endpoint: str, identity: WorkerIdentity, counts: list[int], *, queue_size: int = 64, heartbeat: float = 3600.0
) -> FpmPublisher:
    config = PublisherConfig(
        endpoint=endpoint, heartbeat_interval_s=heartbeat, incarnation="inc-1", queue_size=queue_size
    )
    return FpmPublisher(config, dp_rank=3, identity=identity, activity=lambda: (0, counts[0], counts[1]))


def test_full_queue_drops_are_counted_in_the_next_published_sample(sub: tuple[zmq.Socket, str]) -> None:
    sock, endpoint = sub
    publisher = _publisher(endpoint, WorkerIdentity("w"), [1, 0], queue_size=2)
    # Not started yet, so nothing drains the queue: steps 3..5 find it full.
    for n in range(5):
        _step(publisher, num_decode_requests=n + 1, sum_decode_kv_tokens=10)
    publisher.start()
    try:
        first, second = _recv(sock), _recv(sock)
        assert [first.counter_id, second.counter_id] == [1, 2]
        assert [first.dropped_since_last, second.dropped_since_last] == [0, 0]
        _step(publisher, num_decode_requests=7)
        third = _recv(sock)
        assert third.counter_id == 6 and third.dropped_since_last == 3
        # The gap rule of the proto: counter_id - previous - 1 == dropped_since_last.
        assert third.counter_id - second.counter_id - 1 == third.dropped_since_last
        assert third.kind == STEP and third.scheduled.num_decode_requests == 7
        assert (third.worker_id, third.identity_generation, third.dp_rank, third.incarnation) == ("w", 1, 3, "inc-1")
        assert third.queued.num_prefill_requests == 2 and third.kv_cache_usage == 0.25
        assert (third.num_running, third.num_waiting, third.schema_version) == (1, 2, 1)
        assert third.emit_time.seconds > 0 and third.wall_time == pytest.approx(0.01)
    finally:
        publisher.close()


def test_step_and_heartbeat_paths_read_the_one_identity(sub: tuple[zmq.Socket, str]) -> None:
    sock, endpoint = sub
    identity = WorkerIdentity()
    counts = [0, 0]
    publisher = _publisher(endpoint, identity, counts, heartbeat=0.05).start()
    try:
        beat = _recv(sock)
        assert (beat.kind, beat.idle, beat.worker_id, beat.identity_generation) == (HEARTBEAT, True, "", 0)
        counts[:] = [2, 0]  # from now on requests run but no step finishes: busy heartbeats
        assert identity.set("w-late", 1).generation == 1
        _step(publisher, num_prefill_requests=1, sum_prefill_tokens=9)
        while (step := _recv(sock)).kind != STEP:
            pass
        assert (step.worker_id, step.identity_generation) == ("w-late", 1)
        while (beat := _recv(sock)).counter_id <= step.counter_id:
            pass
        assert (beat.kind, beat.idle, beat.worker_id, beat.identity_generation) == (HEARTBEAT, False, "w-late", 1)
        assert beat.scheduled == fpm_pb2.ScheduledRequestMetrics() and beat.wall_time == 0.0
        assert beat.num_running == 2 and beat.queued.num_prefill_requests == 2  # latest known queue
    finally:
        publisher.close()


def test_close_stops_the_thread_even_with_a_full_queue(sub: tuple[zmq.Socket, str]) -> None:
    _, endpoint = sub
    publisher = _publisher(endpoint, WorkerIdentity(), [0, 0], queue_size=1)
    _step(publisher)
    _step(publisher)
    publisher.start()
    publisher.close(timeout=5.0)
    assert not publisher._thread.is_alive()


def test_identity_generations_only_grow_and_a_retry_is_a_no_op() -> None:
    identity = WorkerIdentity("cold")
    assert (identity.current.worker_id, identity.current.generation) == ("cold", 1)
    assert identity.set("cold", 1) == identity.current
    assert identity.set("new", 2).generation == 2
    with pytest.raises(IdentityError):
        identity.set("other", 2)
    with pytest.raises(IdentityError):
        identity.set("", 3)
    assert (identity.current.worker_id, identity.current.generation) == ("new", 2)
