"""FpmRelay: the server-wide sequence, ring buffer and fan-out of forward-pass metrics.

Runs in the `enginectl serve` process, on the control loop (one thread: nothing here is
locked). Pure Python: no ZMQ, no gRPC server, no vLLM. Frames (contract/fpm.py) come in
through `accept` (relay_zmq.py feeds it from the ranks' publishers) and leave through
`Subscription`s (stream.py serves them over gRPC).

Rules (docs/fpm.md "The stream and the planner", and
forward_pass_metrics_service.proto):
- Every accepted sample gets the next `sequence` (1, 2, ...) and the ledger's current
  `weight_revision`, and enters a ring of the newest `ring_size` samples.
- With `require_identity` (the server runs with `--await-worker-id`), a sample with an empty
  `worker_id` is dropped before it is sequenced, and counted; it never reaches a subscriber.
- `accept` never waits. Each subscription has a bounded queue; when it is full the queue
  coalesces to the latest sample per (worker_id, dp_rank) and counts what was lost, so a
  slow reader costs only itself.
- A subscription may start after a sequence: it then reads the ring directly (no queue)
  until it has caught up with the head, and only then joins the live fan-out, so a resume
  yields every kept sample after that sequence exactly once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from enginectl.contract.fpm import MalformedFrame, read_sample
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1.forward_pass_metrics_pb2 import ForwardPassMetrics as Sample
from enginectl.server.errors import ControlPlaneError, Reason, out_of_range

DEFAULT_RING_SIZE = 10_000
DEFAULT_QUEUE_LIMIT = 4_096
# A replaying subscription scans at most this many ring slots per call, so a sparse filter
# over a large ring never holds the loop for long.
REPLAY_SCAN_LIMIT = 8_192

HEARTBEAT = fpm_pb2.SAMPLE_KIND_HEARTBEAT
# Tags of ForwardPassMetrics.sequence (17) and .weight_revision (18), and of
# ForwardPassMetricsBatch.samples (1), as varint-typed and length-delimited fields.
_SEQUENCE_TAG, _REVISION_TAG, _SAMPLES_TAG = b"\x88\x01", b"\x90\x01", b"\x0a"


def varint(value: int) -> bytes:
    """Protobuf base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Relayed:
    """A relayed sample: the parsed message (for filters and keys) and its wire form as one
    `samples` entry of a ForwardPassMetricsBatch, encoded once and shared by every stream.

    Protobuf lets a serialized message be extended by appending fields, so stamping the
    publisher's frame costs a few bytes, not a re-serialization; the publisher leaves
    `sequence` and `weight_revision` unset (and were they set, the appended values win)."""

    __slots__ = ("sample", "wire")

    def __init__(self, sample: Sample, frame: bytes) -> None:
        self.sample = sample
        stamped = frame + _SEQUENCE_TAG + varint(sample.sequence)
        if sample.weight_revision:
            stamped += _REVISION_TAG + varint(sample.weight_revision)
        self.wire = _SAMPLES_TAG + varint(len(stamped)) + stamped


class RelayClosed(Exception):
    """The relay was closed: subscriptions end. `reason` (an ErrorInfo reason) says why:
    SHUTTING_DOWN, or ENGINE_DEAD when the engine died."""

    def __init__(self, reason: str = Reason.SHUTTING_DOWN, message: str = "server is shutting down") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class RelayStats:
    """Counters since the relay started (read by the Prometheus collector at scrape time)."""

    accepted: int = 0
    # Empty worker_id while identity is required (never sequenced, never relayed).
    dropped_unattributed: int = 0
    # Frames that were not a ForwardPassMetrics of a known schema.
    dropped_malformed: int = 0
    # Samples coalesced away from subscriber queues, summed over subscribers.
    subscriber_missed: int = 0


@dataclass(frozen=True)
class SampleFilter:
    """Which samples a subscription wants. None: no restriction on that field."""

    worker_ids: frozenset[str] | None = None
    dp_ranks: frozenset[int] | None = None
    include_heartbeats: bool = False

    def matches(self, sample: Sample) -> bool:
        if not self.include_heartbeats and sample.kind == HEARTBEAT:
            return False
        if self.worker_ids is not None and sample.worker_id not in self.worker_ids:
            return False
        return self.dp_ranks is None or sample.dp_rank in self.dp_ranks


class SampleRing:
    """The newest `size` samples, addressed by sequence (contiguous from `oldest` to `head`)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("ring size must be at least 1")
        self.size = size
        self._slots: list[Relayed | None] = [None] * size
        self.head = 0  # newest sequence assigned; 0 before the first

    @property
    def oldest(self) -> int:
        """The oldest sequence kept; 0 while empty."""
        if self.head == 0:
            return 0
        return max(1, self.head - self.size + 1)

    def append(self, sample: Sample, frame: bytes) -> Relayed:
        """Stamp `sample` (parsed from `frame`) with the next sequence and keep it."""
        sequence = sample.sequence = self.head + 1
        relayed = self._slots[sequence % self.size] = Relayed(sample, frame)
        self.head = sequence  # after the slot: `newest` on another thread never sees it empty
        return relayed

    def newest(self) -> Relayed | None:
        """The newest sample kept, None while empty. Safe from another thread (a metrics
        scrape): it may miss a sample appended meanwhile, never return an older one."""
        return self._slots[self.head % self.size] if self.head else None

    def get(self, sequence: int) -> Relayed:
        """The sample with `sequence` (caller checks oldest <= sequence <= head)."""
        relayed = self._slots[sequence % self.size]
        assert relayed is not None
        return relayed


class Subscription:
    """One reader of the relay. Create with `FpmRelay.subscribe`; call `close` when done."""

    def __init__(self, relay: FpmRelay, sample_filter: SampleFilter, queue_limit: int, cursor: int | None) -> None:
        self._relay = relay
        self.filter = sample_filter
        self._limit = queue_limit
        self._queue: deque[Relayed] = deque()
        self._missed = 0  # lost since the last batch taken
        self.missed_total = 0
        # Next sequence to read from the ring while replaying; None once live.
        self._cursor = cursor
        self._wake = asyncio.Event()
        self._closed = False

    @property
    def live(self) -> bool:
        return self._cursor is None

    def offer(self, relayed: Relayed) -> None:
        """Called by the relay for each new sample while live. Never waits."""
        if not self.filter.matches(relayed.sample):
            return
        if len(self._queue) >= self._limit:
            self._coalesce()
        self._queue.append(relayed)
        if not self._wake.is_set():
            self._wake.set()

    def _coalesce(self) -> None:
        """Keep only the latest queued sample per (worker_id, dp_rank); count the rest."""
        latest: dict[tuple[str, int], Relayed] = {}
        for relayed in self._queue:
            latest[(relayed.sample.worker_id, relayed.sample.dp_rank)] = relayed
        kept = sorted(latest.values(), key=lambda r: r.sample.sequence)
        # More distinct keys than the queue holds (a tiny limit): drop the oldest keys too.
        kept = kept[len(kept) - self._limit + 1 :] if len(kept) >= self._limit else kept
        lost = len(self._queue) - len(kept)
        self._queue = deque(kept)
        self._missed += lost
        self.missed_total += lost
        self._relay.stats.subscriber_missed += lost

    def take(self, max_size: int) -> tuple[list[Relayed], int]:
        """The samples ready now (at most `max_size`) and how many were lost before them.

        Raises RelayClosed once the relay is closed, and ControlPlaneError OUT_OF_RANGE
        SEQUENCE_EVICTED if a replay fell behind the ring.
        """
        if self._closed:
            raise self._relay.closed_error()
        if self._cursor is not None:
            batch = self._replay(max_size)
        else:
            queue = self._queue
            n = min(max_size, len(queue))
            batch = [queue.popleft() for _ in range(n)]
        missed, self._missed = (self._missed, 0) if batch else (0, self._missed)
        if not self._queue and self._cursor is None:
            self._wake.clear()
        return batch, missed

    def _replay(self, max_size: int) -> list[Relayed]:
        ring = self._relay.ring
        cursor = self._cursor
        assert cursor is not None
        if ring.head >= cursor and cursor < ring.oldest:
            raise self._relay.evicted(cursor - 1)
        batch: list[Relayed] = []
        end = min(ring.head, cursor + REPLAY_SCAN_LIMIT - 1)
        matches = self.filter.matches
        while cursor <= end and len(batch) < max_size:
            relayed = ring.get(cursor)
            cursor += 1
            if matches(relayed.sample):
                batch.append(relayed)
        if cursor > ring.head:
            self._cursor = None  # caught up: the relay offers every later sample
            self._relay._live.add(self)
        else:
            self._cursor = cursor
        return batch

    async def wait(self, timeout: float) -> bool:
        """Wait until samples may be ready (True) or `timeout` passes (False)."""
        if self._closed or self._cursor is not None or self._queue:
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._relay._live.discard(self)
        self._relay._subscriptions.discard(self)

    def _shutdown(self) -> None:
        self._closed = True
        self._wake.set()


class FpmRelay:
    """Sequences, keeps and fans out forward-pass metrics samples."""

    def __init__(
        self,
        *,
        incarnation: str,
        revision: Callable[[], int] = lambda: 0,
        ring_size: int = DEFAULT_RING_SIZE,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        require_identity: bool = False,
    ) -> None:
        if queue_limit < 2:
            raise ValueError("queue limit must be at least 2")
        self.incarnation = incarnation
        self._revision = revision
        self.ring = SampleRing(ring_size)
        self.queue_limit = queue_limit
        # While set, samples with an empty worker_id are dropped here (--await-worker-id).
        self.require_identity = require_identity
        self.stats = RelayStats()
        self._live: set[Subscription] = set()
        self._subscriptions: set[Subscription] = set()
        self._closed = False
        self._close_cause = (Reason.SHUTTING_DOWN, "server is shutting down")

    @property
    def head(self) -> int:
        return self.ring.head

    @property
    def oldest(self) -> int:
        return self.ring.oldest

    # Read at scrape time by server/metrics.py, on another thread: no locks, copies only.

    @property
    def subscribers(self) -> int:
        """Open subscriptions, replaying or live."""
        return len(self._subscriptions)

    def backlog(self) -> int:
        """Samples queued for the live subscription that is furthest behind (0 without one)."""
        # tuple() copies the set in one step under the GIL while the loop may change it.
        return max((len(s._queue) for s in tuple(self._live)), default=0)

    def newest(self) -> Sample | None:
        """The newest sample relayed, None before the first."""
        relayed = self.ring.newest()
        return relayed.sample if relayed is not None else None

    def accept(self, frame: bytes) -> Relayed | None:
        """Take one publisher frame (a serialized ForwardPassMetrics); returns the sample
        as relayed, or None if it was dropped (malformed, or unattributed while identity is
        required)."""
        try:
            sample = read_sample(frame)
        except MalformedFrame:
            self.stats.dropped_malformed += 1
            return None
        if self.require_identity and not sample.worker_id:
            self.stats.dropped_unattributed += 1
            return None
        sample.weight_revision = self._revision()
        relayed = self.ring.append(sample, frame)
        self.stats.accepted += 1
        for subscription in self._live:
            subscription.offer(relayed)
        return relayed

    def subscribe(self, sample_filter: SampleFilter, resume_after: int | None = None) -> Subscription:
        """A new subscription: live from now on, or replaying every kept sample after
        `resume_after` first.

        Raises ControlPlaneError OUT_OF_RANGE: SEQUENCE_IN_FUTURE when `resume_after` is past
        the head, SEQUENCE_EVICTED when a sample after it is no longer kept; RelayClosed
        when the relay is closed.
        """
        if self._closed:
            raise self.closed_error()
        cursor = None
        if resume_after is not None:
            if resume_after > self.ring.head:
                raise out_of_range(
                    Reason.SEQUENCE_IN_FUTURE,
                    f"resume_after_sequence {resume_after} is ahead of the newest sequence "
                    f"{self.ring.head} (from an earlier incarnation?)",
                    head_sequence=str(self.ring.head),
                    incarnation=self.incarnation,
                )
            if resume_after < self.ring.head:
                if resume_after + 1 < self.ring.oldest:
                    raise self.evicted(resume_after)
                cursor = resume_after + 1
        subscription = Subscription(self, sample_filter, self.queue_limit, cursor)
        self._subscriptions.add(subscription)
        if cursor is None:
            self._live.add(subscription)
        return subscription

    def evicted(self, resume_after: int) -> ControlPlaneError:
        return out_of_range(
            Reason.SEQUENCE_EVICTED,
            f"samples after sequence {resume_after} are no longer kept (the oldest kept is "
            f"{self.ring.oldest}); subscribe again without resume_after_sequence, or after "
            f"oldest_sequence - 1",
            oldest_sequence=str(self.ring.oldest),
            head_sequence=str(self.ring.head),
            incarnation=self.incarnation,
        )

    def close(self, reason: str = Reason.SHUTTING_DOWN, message: str = "server is shutting down") -> None:
        """End every subscription with RelayClosed(reason, message); the first close's reason
        stays (the engine died, then the server shuts down: ENGINE_DEAD)."""
        if not self._closed:
            self._close_cause = (reason, message)
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription._shutdown()

    def closed_error(self) -> RelayClosed:
        """What a subscription of the closed relay raises."""
        return RelayClosed(*self._close_cause)
