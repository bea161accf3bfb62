"""FpmRelay: the server-wide sequence, ring buffer and fan-out of forward-pass metrics.

Runs in the `enginectl serve` process, on the control loop (one thread: nothing here is
locked). Pure Python: no ZMQ, no gRPC server, no vLLM. Frames (contract/fpm.py) come in
through `accept` (relay_zmq.py feeds it from the ranks' publishers) and leave through
`Subscription`s (stream.py serves them over gRPC); the records they become, the ring that
keeps them and the filters that select them are samples.py.

Rules (docs/fpm.md "The stream and the planner", and
forward_pass_metrics_service.proto):
- Every accepted sample gets the next `sequence` (1, 2, ...) and the ledger's current
  `weight_revision`, and enters a ring of the newest `ring_size` samples.
- With `require_identity` (the server runs with `--await-worker-id`), a sample with an empty
  `worker_id` is dropped before it is sequenced, and counted; it never reaches a subscriber.
- `accept_many` never waits. Each subscription has a bounded queue; when it is full the
  queue coalesces to the latest sample per (worker_id, dp_rank) and counts what was lost, so
  a slow reader costs only itself.
- Work is per batch of frames, not per sample and subscriber: a batch is sequenced once,
  selected once per distinct filter, and appended to each queue in one step; a queue wakes
  its stream once per batch.
- Taking frames is two steps, so the intake can spread a batch over several loop turns:
  `prepare` parses and gates (most of the cost), `commit` sequences, keeps and offers in
  one call (`accept_many` does both).
- When the intake is behind (relay_zmq.py: a backlog beyond INTAKE_BACKLOG frames), the
  oldest are accepted with `coalesce=True`: sequenced and kept in the ring as always, but
  live subscriptions are offered only the latest sample per (worker_id, dp_rank) of the
  batch (and kind: step or heartbeat), and each is told the others its filter selects as
  `missed` (still in the ring: a resume fetches them). That is the queue rule applied once
  at intake instead of once per queue, so overload costs a parse and a sequence number per
  sample.
- A subscription may start after a sequence: it then reads the ring directly (no queue)
  until it has caught up with the head, and only then joins the live fan-out, so a resume
  yields every kept sample after that sequence exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter

from enginectl.contract.fpm import FrameError, parse_frame
from enginectl.fpm.v1.forward_pass_metrics_pb2 import ForwardPassMetrics as Sample
from enginectl.server.errors import ControlPlaneError, Reason, out_of_range
from enginectl.server.fpm.samples import HEARTBEAT, Relayed, SampleFilter, SampleRing

DEFAULT_RING_SIZE = 10_000
DEFAULT_QUEUE_LIMIT = 4_096
# A replaying subscription scans at most this many ring slots per call, so a sparse filter
# over a large ring never holds the loop for long.
REPLAY_SCAN_LIMIT = 8_192

_by_sequence = attrgetter("sequence")


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
    # Frames that did not begin with this start's key (incarnation and channel secret): a
    # publisher of another start, or a stranger on the TCP endpoint (DESIGN §13).
    dropped_unkeyed: int = 0
    # Samples subscribers were told they missed (coalesced away from their queues, or at
    # intake), summed over subscribers.
    subscriber_missed: int = 0
    # Samples sequenced while the intake was behind and offered to no live subscription
    # (the latest per worker and rank was); counted once, not per subscriber.
    coalesced_at_intake: int = 0


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

    def offer(self, selected: list[Relayed]) -> None:
        """Called by the relay with each new batch's samples this subscription's filter
        selected, while live. Never waits: a full queue coalesces, exactly as if the samples
        had come one at a time (it coalesces when a sample arrives to a full queue)."""
        limit, start, end = self._limit, 0, len(selected)
        while end - start > limit - len(self._queue):
            room = limit - len(self._queue)
            self._queue.extend(selected[start : start + room])
            start += room
            self._coalesce()
        self._queue.extend(selected[start:] if start else selected)
        if not self._wake.is_set():
            self._wake.set()

    def skip(self, count: int) -> None:
        """Count `count` samples this subscription was not offered (coalesced at intake);
        its next batch reports them in `missed`."""
        self._missed += count
        self.missed_total += count
        self._relay.stats.subscriber_missed += count

    def _coalesce(self) -> None:
        """Keep only the latest queued sample per (worker_id, dp_rank); count the rest."""
        latest = {relayed.key: relayed for relayed in self._queue}
        kept = sorted(latest.values(), key=_by_sequence)
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
            if len(queue) <= max_size:
                batch = list(queue)
                queue.clear()
            else:
                batch = [queue.popleft() for _ in range(max_size)]
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
        wants = self.filter.wants
        while cursor <= end and len(batch) < max_size:
            relayed = ring.get(cursor)
            cursor += 1
            if wants(relayed.key, relayed.heartbeat):
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
        key: bytes = b"",
    ) -> None:
        if queue_limit < 2:
            raise ValueError("queue limit must be at least 2")
        self.incarnation = incarnation
        # Every frame begins with it (contract/engine_config.py `frame_key`); b"": no key.
        self.key = key
        # dp_rank -> time.monotonic() of its latest keyed frame: what the rank watch reads
        # (server/fpm/rank_watch.py).
        self.last_seen: dict[int, float] = {}
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
        batch = self.prepare((frame,))
        self.commit(batch)
        return batch[0] if batch else None

    def accept_many(self, frames: Iterable[bytes], *, coalesce: bool = False) -> int:
        """Take publisher frames in arrival order and fan them out as one batch; returns how
        many were sequenced (the rest were dropped as in `accept`). With `coalesce` (the
        intake is behind) live subscriptions are offered only the latest sample per
        (worker_id, dp_rank) of the batch and told the rest as missed; all are kept."""
        batch = self.prepare(frames)
        self.commit(batch, coalesce=coalesce)
        return len(batch)

    def prepare(self, frames: Iterable[bytes], into: list[Relayed] | None = None) -> list[Relayed]:
        """Parse and gate `frames` (dropping and counting the malformed and, with
        `require_identity`, the unattributed), appending the rest to `into` (a new list by
        default), not yet sequenced: `commit` them, in order, in as many slices as the caller
        likes; nothing is kept or offered until then.

        The intake's hot loop (a few hundred thousand frames a second under overload): the
        frame rules (contract/fpm.py) are inline, a call per frame saved."""
        require_identity = self.require_identity
        parse, heartbeat = parse_frame, HEARTBEAT
        key, cut = self.key, len(self.key)
        malformed = unattributed = unkeyed = 0
        seen: dict[int, float] = {}
        batch: list[Relayed] = [] if into is None else into
        keep = batch.append
        for frame in frames:
            if cut:
                if not frame.startswith(key):
                    unkeyed += 1
                    continue
                frame = frame[cut:]
            try:
                sample = parse(frame)
            except FrameError:
                malformed += 1
                continue
            if not sample.schema_version:
                malformed += 1
                continue
            dp_rank = sample.dp_rank
            seen[dp_rank] = 0.0
            worker_id = sample.worker_id
            if require_identity and not worker_id:
                unattributed += 1
                continue
            keep(Relayed((worker_id, dp_rank), sample.kind == heartbeat, frame))
        if seen:
            now = time.monotonic()
            self.last_seen.update(dict.fromkeys(seen, now))
        stats = self.stats
        stats.dropped_malformed += malformed
        stats.dropped_unattributed += unattributed
        stats.dropped_unkeyed += unkeyed
        return batch

    def commit(self, batch: list[Relayed], *, coalesce: bool = False) -> None:
        """Sequence and stamp `batch` (from `prepare`), keep it in the ring, and offer it to
        every live subscription (coalesced, see `accept_many`), all in this one call: a
        subscription never sees a kept sample that was not offered yet."""
        if not batch:
            return
        revision = self._revision()  # one call: no declaration lands in between
        ring = self.ring
        slots, size, sequence = ring.slots, ring.size, ring.head
        for relayed in batch:  # the ring's append, inline
            sequence += 1
            relayed.sequence = sequence
            relayed.revision = revision
            slots[sequence % size] = relayed
        ring.head = sequence  # after the slots: `newest` on another thread never sees one empty
        self.stats.accepted += len(batch)
        if self._live:
            if coalesce:
                self._offer_coalesced(batch)
            else:
                self._offer(batch)

    def _offer(self, batch: list[Relayed]) -> None:
        # One selection per distinct filter (streams of a fleet often share one).
        selections: dict[SampleFilter, list[Relayed]] = {}
        for subscription in self._live:
            selected = selections.get(subscription.filter)
            if selected is None:
                selected = selections[subscription.filter] = subscription.filter.select(batch)
            if selected:
                subscription.offer(selected)

    def _offer_coalesced(self, batch: list[Relayed]) -> None:
        """Offer the latest sample per (worker_id, dp_rank) of `batch`, per kind (so a
        filter without heartbeats still gets the latest step); every live subscription skips
        the others its filter selects."""
        latest = {(relayed.key, relayed.heartbeat): relayed for relayed in batch}
        kept = sorted(latest.values(), key=_by_sequence)
        shed = Counter([(relayed.key, relayed.heartbeat) for relayed in batch])
        shed.subtract(latest.keys())
        self.stats.coalesced_at_intake += len(batch) - len(kept)
        self._offer(kept)
        skipped: dict[SampleFilter, int] = {}
        for subscription in self._live:
            count = skipped.get(subscription.filter)
            if count is None:
                wants = subscription.filter.wants
                count = skipped[subscription.filter] = sum(n for (key, hb), n in shed.items() if wants(key, hb))
            if count:
                subscription.skip(count)

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
