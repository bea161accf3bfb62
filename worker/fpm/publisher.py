"""FpmPublisher: makes a rank's forward-pass metrics samples and sends them to the relay.

Runs inside each EngineCore process. Two threads touch it:
- the engine thread (through the FPM scheduler) reports each step once its output is
  processed (`step_finished`). A non-empty step becomes a STEP sample. This path never blocks: the sample goes into a bounded queue, and when the
  queue is full it is dropped and counted in the next published sample's
  `dropped_since_last`;
- the publisher thread (owned here) drains the queue, builds the protobuf and sends it as a
  frame (contract/fpm.py) on a ZMQ XPUB socket connected to the relay's `ipc://` endpoint, and
  makes a HEARTBEAT sample whenever no sample was made for the heartbeat interval
  (HeartbeatTimer);
- the engine thread also makes a HEARTBEAT sample at once whenever the rank's generation
  state changes (`state_changed`, called by RankGeneration): a pause, a resume, a weight load
  starting or ending shows on the stream when it happens.

Every sample is stamped, when it is made, with the identity held in the one WorkerIdentity
of the rank and the generation state held in its one RankGeneration, and gets the next
`counter_id` (from 1, dropped samples included).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from enginectl.common.host import HostIdentity, host_identity
from enginectl.contract.engine_config import EngineConfig
from enginectl.contract.fpm import SCHEMA_VERSION, sample_frame
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.worker.fpm.generation import RUNNING, GenerationStatus, RankGeneration
from enginectl.worker.fpm.identity import IdentityState, WorkerIdentity
from enginectl.worker.fpm.load import EMPTY_QUEUE, NO_STEP, QueuedLoad, ScheduledLoad
from enginectl.worker.fpm.timing import DEFAULT_HEARTBEAT_INTERVAL_S, HeartbeatTimer, is_idle

log = logging.getLogger("enginectl.worker.fpm")

DEFAULT_QUEUE_SIZE = 4096
SEND_HWM = 4096
CLOSE_TIMEOUT_S = 2.0
SUBSCRIBE_WAIT_S = 10.0
# While samples flow, the publisher thread polls its queue every POLL_INTERVAL_S (the most it
# adds to a sample's latency) instead of being woken per sample; after ACTIVE_WINDOW_S without
# one it sleeps until woken by the next sample or its heartbeat.
POLL_INTERVAL_S = 0.001
ACTIVE_WINDOW_S = 0.1
# A headless node's rank pings its head's relay this often (ZMTP heartbeats).
HEAD_HEARTBEAT_IVL_MS = 1000


@dataclass(frozen=True)
class PublisherConfig:
    """One rank's publisher settings, from the EngineConfig `enginectl serve` hands it."""

    endpoint: str  # the relay's ZMQ SUB endpoint; "" publishes nothing
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    incarnation: str = ""
    queue_size: int = DEFAULT_QUEUE_SIZE
    key: bytes = b""  # every frame begins with it (contract/engine_config.py `frame_key`)
    # A headless node's rank: without a connection to the relay for this long, the head is
    # gone and `head_lost` is called (0: not watched).
    watch_head_s: float = 0.0

    @classmethod
    def from_engine_config(cls, config: EngineConfig, host: HostIdentity | None = None) -> PublisherConfig:
        """The publisher's part of `config` for a rank on `host` (default: this one), with
        the defaults where it leaves one open."""
        host = host or host_identity()
        return cls(
            endpoint=config.fpm_endpoint_for(host.hostname, host.boot_id),
            heartbeat_interval_s=config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S,
            # Never empty on the wire: a server that did not choose one still gets a unique id.
            incarnation=config.incarnation or secrets.token_hex(8),
            key=config.frame_key(),
            watch_head_s=config.liveness_timeout_s if config.headless else 0.0,
        )


class _HeadWatch:
    """A headless node rank's view of its connection to the head's relay (publisher thread
    only): down since when. It counts from the start: a head that never answers is silent."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.down_since: float | None = time.monotonic()

    def connection(self, up: bool, now: float) -> None:
        if up:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = now

    def silent_for(self, now: float) -> float | None:
        """How long the head has been unreachable, once that is past the bound (else None)."""
        if self.down_since is None or now - self.down_since < self.bound_s:
            return None
        return now - self.down_since


class Sample(NamedTuple):
    """A sample as made on the engine or heartbeat path, before it becomes a protobuf (a
    NamedTuple: cheap to build on the engine thread)."""

    kind: fpm_pb2.SampleKind.ValueType
    counter_id: int
    identity: IdentityState
    emit_time_ns: int
    wall_time: float
    idle: bool
    scheduled: ScheduledLoad
    queued: QueuedLoad
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    dropped_since_last: int
    generation: GenerationStatus = RUNNING


def sample_proto(sample: Sample, dp_rank: int, incarnation: str) -> fpm_pb2.ForwardPassMetrics:
    """The ForwardPassMetrics message for `sample` (`sequence`, `weight_revision` left to the relay)."""
    s, q = sample.scheduled, sample.queued
    msg = fpm_pb2.ForwardPassMetrics(
        schema_version=SCHEMA_VERSION,
        worker_id=sample.identity.worker_id,
        dp_rank=dp_rank,
        counter_id=sample.counter_id,
        identity_generation=sample.identity.generation,
        incarnation=incarnation,
        wall_time=sample.wall_time,
        idle=sample.idle,
        # ScheduledLoad / QueuedLoad mirror the proto messages field for field.
        scheduled=fpm_pb2.ScheduledRequestMetrics(**s._asdict()),
        queued=fpm_pb2.QueuedRequestMetrics(**q._asdict()),
        kv_cache_usage=sample.kv_cache_usage,
        num_running=sample.num_running,
        num_waiting=sample.num_waiting,
        dropped_since_last=sample.dropped_since_last,
        kind=sample.kind,
        generation_state=sample.generation.state,
        pause_reason=sample.generation.pause_reason,
    )
    msg.emit_time.FromNanoseconds(sample.emit_time_ns)
    return msg


class FpmPublisher:
    """One rank's sample maker and its publisher thread (see the module docstring)."""

    def __init__(
        self,
        config: PublisherConfig,
        *,
        dp_rank: int,
        identity: WorkerIdentity,
        activity: Callable[[], tuple[int, int, int]],
        generation: RankGeneration | None = None,
        clock: Callable[[], float] = time.monotonic,
        head_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.identity = identity
        self.generation = generation if generation is not None else RankGeneration()
        # (steps in flight, running requests, waiting requests) of the rank, read on heartbeats
        self._activity = activity
        self._lock = threading.Lock()  # guards the counter, the drop count and the timer's clock
        self._timer = HeartbeatTimer(config.heartbeat_interval_s, clock)
        # The bounded queue: a deque (appends are atomic); the engine thread wakes the publisher
        # thread only when it sleeps after a quiet spell (see POLL_INTERVAL_S).
        self._queue: deque[Sample] = deque()
        self._wake = threading.Condition(threading.Lock())
        self._sleeping = False
        self._counter = 0
        self._dropped = 0
        self._last_queued = EMPTY_QUEUE  # heartbeats repeat the latest known queue and usage
        self._last_kv_usage = 0.0
        self._send_drops = 0  # publisher thread only
        self._stop = threading.Event()
        # Called once, on the publisher thread, when the head is silent past watch_head_s.
        self._head_lost = head_lost
        self._head = _HeadWatch(config.watch_head_s) if config.watch_head_s > 0 else None
        self._thread = threading.Thread(target=self._run, name="enginectl-fpm-publisher", daemon=True)

    def start(self) -> FpmPublisher:
        self._thread.start()
        return self

    # -- engine thread ---------------------------------------------------------------------
    def step_finished(
        self,
        wall_time: float,
        scheduled: ScheduledLoad | None,
        queued: QueuedLoad,
        kv_cache_usage: float,
        num_running: int,
        num_waiting: int,
    ) -> None:
        """A step's output was processed; `scheduled` is None for an empty step (no sample)."""
        self._last_queued, self._last_kv_usage = queued, kv_cache_usage
        if scheduled is not None:
            with self._lock:
                self._make(fpm_pb2.SAMPLE_KIND_STEP, wall_time, False, scheduled, num_running, num_waiting)

    def state_changed(self) -> None:
        """The rank's generation state changed: publish it now, as a heartbeat (never blocks)."""
        in_flight, running, waiting = self._activity()
        with self._lock:
            self._make(
                fpm_pb2.SAMPLE_KIND_HEARTBEAT, 0.0, is_idle(in_flight, running, waiting), NO_STEP, running, waiting
            )

    # -- both threads, under the lock ------------------------------------------------------
    def _make(
        self,
        kind: fpm_pb2.SampleKind.ValueType,
        wall_time: float,
        idle: bool,
        scheduled: ScheduledLoad,
        num_running: int,
        num_waiting: int,
    ) -> None:
        self._counter += 1
        self._timer.sample_made()
        if len(self._queue) >= self.config.queue_size:
            self._dropped += 1
            return
        self._queue.append(
            Sample(
                kind,
                self._counter,
                self.identity.current,
                time.time_ns(),
                wall_time,
                idle,
                scheduled,
                self._last_queued,
                self._last_kv_usage,
                num_running,
                num_waiting,
                self._dropped,
                self.generation.current,
            )
        )
        self._dropped = 0
        if self._sleeping:
            with self._wake:
                self._wake.notify()

    # -- publisher thread ------------------------------------------------------------------
    def _heartbeat_if_due(self) -> None:
        in_flight, running, waiting = self._activity()
        with self._lock:
            idle = self._timer.poll(in_flight, running, waiting)
            if idle is not None:
                self._make(fpm_pb2.SAMPLE_KIND_HEARTBEAT, 0.0, idle, NO_STEP, running, waiting)

    def _run(self) -> None:
        ctx = zmq.Context()
        # XPUB: a PUB socket that also shows us the relay's subscription, so the first
        # samples are not sent (and silently dropped by ZMQ) before the relay subscribed.
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 200)  # a short flush on close, never a hang
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        # At the high-water mark, fail the send (counted in dropped_since_last) instead of
        # ZMQ's default silent drop.
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        monitor: zmq.Socket[Any] | None = None
        if self._head is not None:
            # ZMTP heartbeats: a head that stops answering (stopped, or the network between
            # gone) drops the connection after the bound, as a dead one's kernel does at once.
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEAD_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.config.watch_head_s * 1000))
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            if self.config.endpoint:
                sock.connect(self.config.endpoint)
                self._await_subscriber(sock)
            active_until = 0.0
            while not self._stop.is_set():
                if monitor is not None and self._head_silent(monitor):
                    return
                if self._queue:
                    while self._queue:
                        self._send(sock, self._queue.popleft())
                    active_until = time.monotonic() + ACTIVE_WINDOW_S
                    continue
                with self._lock:
                    wait = self._timer.seconds_until_due()
                if wait <= 0:
                    self._heartbeat_if_due()
                    continue
                if time.monotonic() < active_until:
                    # Steps are flowing: poll rather than have the engine thread wake us on
                    # every sample (a wake-up costs the engine thread a context switch).
                    time.sleep(min(POLL_INTERVAL_S, wait))
                    continue
                with self._wake:
                    # Set before the re-check: a sample appended after it sees the flag and wakes us.
                    self._sleeping = True
                    if not self._queue and not self._stop.is_set():
                        self._wake.wait(wait)
                    self._sleeping = False
        except Exception:  # never take the engine down; the relay sees the silence
            log.exception("enginectl FPM publisher stopped")
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(0)
            sock.close()
            ctx.term()

    def _head_silent(self, monitor: zmq.Socket[Any]) -> bool:
        """Read the connection's events; once it has been down past the bound, report the
        head lost (once) and answer True: the thread ends."""
        from zmq.utils.monitor import recv_monitor_message

        head = self._head
        assert head is not None
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            head.connection(event == zmq.EVENT_CONNECTED, time.monotonic())
        silent = head.silent_for(time.monotonic())
        if silent is None:
            return False
        message = (
            f"the head at {self.config.endpoint} has been unreachable for {silent:.1f}s "
            f"(bound {self.config.watch_head_s:.1f}s): this node stops its EngineCores"
        )
        log.error("enginectl: %s", message)
        if self._head_lost is not None:
            self._head_lost(message)
        return True

    def _await_subscriber(self, sock: zmq.Socket[Any]) -> None:
        """Wait (bounded) for the relay's subscription; samples made meanwhile stay queued."""
        deadline = time.monotonic() + SUBSCRIBE_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            if sock.poll(100, zmq.POLLIN):
                sock.recv()
                return
        log.warning("enginectl FPM relay did not subscribe within %.0fs; publishing anyway", SUBSCRIBE_WAIT_S)

    def _send(self, sock: zmq.Socket[Any], sample: Sample) -> None:
        if not self.config.endpoint:
            return
        msg = sample_proto(sample, self.dp_rank, self.config.incarnation)
        # Samples leave in counter order, so send failures add up exactly into the next one.
        msg.dropped_since_last += self._send_drops
        try:
            sock.send(self.config.key + sample_frame(msg), zmq.NOBLOCK)
        except zmq.Again:  # the relay is not reading fast enough: a drop like a full queue
            self._send_drops = msg.dropped_since_last + 1
        else:
            self._send_drops = 0

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread and close the socket; returns within about `timeout`."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
