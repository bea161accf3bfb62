"""Planner consumer: forward-pass metrics from a fleet of servers, reconciled.

Runs in a planner or autoscaler process; imports neither torch nor vLLM (grpc.aio only).

- `FleetView` (pure, no I/O): the latest sample per (endpoint, worker_id, dp_rank) with its
  age and the rank's generation state (running, paused and why, applying an update), the
  latest sample it made while generating, every sample counted per endpoint and worker id,
  and `reconcile`.
- `Planner` (asyncio): one StreamForwardPassMetrics per endpoint, heartbeats included, no
  server-side filter (so unattributed samples are seen and counted, never silently
  dropped). A broken stream reconnects with exponential backoff and resumes after the last
  sequence it processed, in the same incarnation; a restarted server (INCARNATION_CHANGED)
  or an evicted resume point (SEQUENCE_EVICTED) re-subscribes live, and a restart clears
  that endpoint's samples.
- `PlannerThread`: the same from blocking code (a Planner on the blocking clients' loop
  thread, see _sync.py).

    async with Planner(["10.0.0.1:50051", "10.0.0.2:50051"]) as planner:
        verdict = planner.reconcile({"worker-a", "worker-b"}, dp_size=2)
        if verdict.ok: ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import random
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from enginectl.client._sync import LoopThread
from enginectl.client.client import ChannelConfig
from enginectl.client.errors import EnginectlError, Reason
from enginectl.client.fpm import (
    FpmBatch,
    FpmGenerationState,
    FpmProgress,
    FpmSample,
    stream_forward_pass_metrics,
    stream_request,
)
from enginectl.client.rank_ranges import ExpectedRanks

DEFAULT_STALE_AFTER_S = 5.0
DEFAULT_BACKOFF_INITIAL_S = 0.1
DEFAULT_BACKOFF_MAX_S = 5.0


class Verdict(str, enum.Enum):
    """Outcome of `reconcile`, in the order the checks run (the first failing one wins)."""

    OK = "OK"
    NO_FPM_DATA = "NO_FPM_DATA"  # no sample from any expected worker yet
    STALE = "STALE"  # an expected worker's rank went quiet
    WORKER_COUNT_MISMATCH = "WORKER_COUNT_MISMATCH"  # distinct expected ids seen != expected
    INCONSISTENT_DP_RANKS = "INCONSISTENT_DP_RANKS"  # workers report different rank counts
    INCOMPLETE_COVERAGE = "INCOMPLETE_COVERAGE"  # (worker, rank) pairs != workers x dp_size
    # The servers of an engine do not tile its ranks (a gap, an overlap): ExpectedRanks.problems.
    RANK_RANGES_INVALID = "RANK_RANGES_INVALID"


@dataclass(frozen=True)
class RankState:
    """The latest sample of one rank of one endpoint, and how long ago it arrived.

    A load model leaves pauses and weight updates out by reading `last_running` (the newest
    sample the rank made while generating, `sample` itself when it is generating now) instead
    of `sample`, or by skipping ranks that are not `generating` (docs/fpm.md).
    """

    endpoint: str
    worker_id: str
    dp_rank: int
    sample: FpmSample
    age_s: float
    last_running: FpmSample | None = None  # None: no generating sample since (re)start

    @property
    def generation_state(self) -> FpmGenerationState:
        """What the rank's generation is doing, as of its latest sample."""
        return self.sample.generation_state

    @property
    def pause_reason(self) -> str:
        """Who holds the rank's pause while PAUSED or APPLYING ("UNSPECIFIED" while running)."""
        return self.sample.pause_reason

    @property
    def generating(self) -> bool:
        """Whether the rank's latest sample says it generates (see FpmSample.generating)."""
        return self.sample.generating


@dataclass(frozen=True)
class Reconciliation:
    """A verdict on the fleet, with what it was based on.

    `unattributed` counts, per endpoint, every sample received whose worker id was empty or
    not expected (cumulative since the planner started); `unattributed_ranks` are the ranks
    whose latest sample is such a sample now.
    """

    verdict: Verdict
    detail: str
    workers: dict[str, tuple[int, ...]]
    stale: tuple[RankState, ...]
    unattributed: dict[str, int]
    unattributed_ranks: tuple[RankState, ...]

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK


class FleetView:
    """The latest sample per (endpoint, dp_rank) and sample counts per (endpoint, worker_id).

    A rank has one identity at a time: its newest sample replaces the previous one whatever
    worker id either carries, so a rank that was unattributed stops being so after its
    identity is set. Ages use the planner's monotonic clock at arrival (no host clock skew).
    Each rank also keeps its newest sample made while generating (`RankState.last_running`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[tuple[str, int], tuple[FpmSample, float]] = {}
        self._running: dict[tuple[str, int], FpmSample] = {}
        self._counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def record(self, endpoint: str, sample: FpmSample) -> None:
        key = (endpoint, sample.dp_rank)
        self._latest[key] = (sample, self._clock())
        if sample.generating:
            self._running[key] = sample
        self._counts[endpoint][sample.worker_id] += 1

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint's latest samples (it restarted); its counts stay."""
        for key in [k for k in self._latest if k[0] == endpoint]:
            del self._latest[key]
            self._running.pop(key, None)

    def latest(self, workers: Collection[str] | None = None) -> list[RankState]:
        """Every rank's latest sample, optionally only those of `workers`, by (endpoint, rank)."""
        now = self._clock()
        return [
            RankState(endpoint, sample.worker_id, rank, sample, now - arrived, self._running.get((endpoint, rank)))
            for (endpoint, rank), (sample, arrived) in sorted(self._latest.items())
            if workers is None or sample.worker_id in workers
        ]

    def sample_counts(self, endpoint: str) -> dict[str, int]:
        """Samples received from `endpoint`, per worker id ("" for unattributed)."""
        return dict(self._counts.get(endpoint, {}))

    def reconcile(
        self,
        expected_workers: Iterable[str] | Mapping[str, Collection[int]] | ExpectedRanks,
        dp_size: int | None = None,
        *,
        stale_after: float = DEFAULT_STALE_AFTER_S,
    ) -> Reconciliation:
        """Judge whether the fleet's FPM data covers what is expected: `expected_workers` x
        ranks 0..`dp_size`-1, or per worker id its own ranks (a mapping, or the ExpectedRanks
        that client/rank_ranges.py `expected_ranks` reads off the servers' managed ranks, for
        servers that each manage some ranks of one engine: docs/multinode.md)."""
        if isinstance(expected_workers, ExpectedRanks) and expected_workers.problems:
            return Reconciliation(Verdict.RANK_RANGES_INVALID, expected_workers.problems, {}, (), {}, ())
        per_worker = _per_worker(expected_workers, dp_size)
        expected = set(per_worker)
        ranks = self.latest()
        known = [r for r in ranks if r.worker_id in expected]
        unattributed = {
            endpoint: sum(n for wid, n in counts.items() if wid not in expected)
            for endpoint, counts in self._counts.items()
        }
        loose = tuple(r for r in ranks if r.worker_id not in expected)
        workers: dict[str, list[int]] = defaultdict(list)
        for r in known:
            workers[r.worker_id].append(r.dp_rank)
        seen = {w: tuple(sorted(rs)) for w, rs in sorted(workers.items())}
        stale = tuple(r for r in known if r.age_s > stale_after)

        def verdict(v: Verdict, detail: str) -> Reconciliation:
            return Reconciliation(v, detail, seen, stale, unattributed, loose)

        if not known:
            return verdict(
                Verdict.NO_FPM_DATA,
                f"no sample from any of {len(expected)} expected workers" + _unattributed_note(unattributed),
            )
        if stale:
            names = ", ".join(f"{r.worker_id}/{r.dp_rank}@{r.endpoint} ({r.age_s:.1f}s)" for r in stale)
            return verdict(Verdict.STALE, f"no sample for more than {stale_after}s from {names}")
        if len(seen) != len(expected):
            missing = sorted(expected - set(seen))
            return verdict(
                Verdict.WORKER_COUNT_MISMATCH,
                f"{len(seen)} of {len(expected)} expected workers publish; missing {missing}"
                + _unattributed_note(unattributed),
            )
        if dp_size is not None and len({len(rs) for rs in seen.values()}) > 1:
            counts = {w: len(rs) for w, rs in seen.items()}
            return verdict(Verdict.INCONSISTENT_DP_RANKS, f"dp ranks per worker differ: {counts}")
        partial = {w: rs for w, rs in seen.items() if rs != per_worker[w]}
        if partial:
            want = {w: list(per_worker[w]) for w in partial}
            return verdict(Verdict.INCOMPLETE_COVERAGE, f"expected ranks {want}; got {partial}")
        if dp_size is not None:
            return verdict(Verdict.OK, f"{len(seen)} workers x {dp_size} ranks, all fresh")
        return verdict(Verdict.OK, f"{len(seen)} workers, {sum(map(len, seen.values()))} ranks, all fresh")


def _per_worker(
    expected: Iterable[str] | Mapping[str, Collection[int]] | ExpectedRanks, dp_size: int | None
) -> dict[str, tuple[int, ...]]:
    """Worker id -> the ranks expected of it, sorted."""
    if isinstance(expected, ExpectedRanks):
        return dict(expected.by_worker)
    if isinstance(expected, Mapping):
        return {w: tuple(sorted(rs)) for w, rs in expected.items()}
    if dp_size is None:
        raise TypeError("reconcile(worker ids, dp_size): dp_size is needed with a set of worker ids")
    return {w: tuple(range(dp_size)) for w in expected}


def _unattributed_note(unattributed: dict[str, int]) -> str:
    loose = {e: n for e, n in unattributed.items() if n}
    return f"; unattributed samples per endpoint: {loose}" if loose else ""


@dataclass
class EndpointStatus:
    """How one endpoint's stream is doing."""

    endpoint: str
    connected: bool = False
    incarnation: str = ""
    last_sequence: int | None = None  # resume point: last sample or progress processed
    samples: int = 0
    missed: int = 0  # coalesced away by the server because this planner read too slowly
    reconnects: int = 0
    restarts: int = 0  # the server's incarnation changed
    resyncs: int = 0  # OUT_OF_RANGE: re-subscribed live
    last_error: EnginectlError | None = field(default=None, repr=False)


class Planner:
    """Follows the FPM streams of many servers; see the module docstring."""

    def __init__(
        self,
        endpoints: Sequence[str | ChannelConfig],
        *,
        stale_after: float = DEFAULT_STALE_AFTER_S,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL_S,
        backoff_max: float = DEFAULT_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stale_after = stale_after
        self._backoff = (backoff_initial, backoff_max)
        self._configs = [self._with_reconnect_backoff(e) for e in endpoints]
        self.fleet = FleetView(clock)
        self.status = {c.target: EndpointStatus(c.target) for c in self._configs}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed: asyncio.Condition | None = None
        self._closing = asyncio.Event()

    def _with_reconnect_backoff(self, endpoint: str | ChannelConfig) -> ChannelConfig:
        """gRPC's own reconnect backoff grows to 2 minutes; keep it within the planner's, so a
        server that comes back is followed again within `backoff_max` (options given win)."""
        config = endpoint if isinstance(endpoint, ChannelConfig) else ChannelConfig(target=endpoint)
        ours = {
            "grpc.initial_reconnect_backoff_ms": int(self._backoff[0] * 1000),
            "grpc.max_reconnect_backoff_ms": int(self._backoff[1] * 1000),
        }
        given = {name for name, _ in config.options}
        extra = tuple((k, v) for k, v in ours.items() if k not in given)
        return dataclasses.replace(config, options=(*config.options, *extra))

    async def __aenter__(self) -> Planner:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Start following every endpoint (call on the loop that will run the planner)."""
        self._changed = asyncio.Condition()
        self._tasks = [asyncio.create_task(self._follow(c), name=f"fpm:{c.target}") for c in self._configs]

    async def close(self) -> None:
        self._closing.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def reconcile(
        self,
        expected_workers: Iterable[str] | Mapping[str, Collection[int]] | ExpectedRanks,
        dp_size: int | None = None,
    ) -> Reconciliation:
        """See FleetView.reconcile (with this planner's staleness window)."""
        return self.fleet.reconcile(expected_workers, dp_size, stale_after=self.stale_after)

    async def wait_for(self, predicate: Callable[[Planner], bool], timeout: float) -> bool:
        """Wait until `predicate(self)` holds, re-checked on every stream message; False on
        timeout. Time-based conditions (staleness) are re-checked at least every 100 ms."""
        assert self._changed is not None, "start() first"
        deadline = time.monotonic() + timeout
        async with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
                except asyncio.TimeoutError:
                    pass
        return True

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _follow(self, config: ChannelConfig) -> None:
        status = self.status[config.target]
        delay = self._backoff[0]
        async with config.aio_channel() as channel:
            while not self._closing.is_set():
                resume = status.last_sequence if status.incarnation else None
                request = stream_request(
                    include_heartbeats=True,
                    resume_after_sequence=resume,
                    resume_incarnation=status.incarnation if resume is not None else "",
                )
                try:
                    async for event in stream_forward_pass_metrics(channel, request, config):
                        self._apply(status, event)
                        delay = self._backoff[0]
                        await self._notify()
                except EnginectlError as err:
                    status.last_error = err
                    if err.code is grpc.StatusCode.OUT_OF_RANGE:
                        self._resync(status, err)
                        await self._notify()
                        continue
                status.connected = False
                await self._notify()
                status.reconnects += 1
                try:  # back off, unless closing
                    await asyncio.wait_for(self._closing.wait(), delay * random.uniform(0.8, 1.2))
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self._backoff[1])

    def _apply(self, status: EndpointStatus, event: FpmBatch | FpmProgress) -> None:
        if isinstance(event, FpmProgress):
            if status.incarnation and event.incarnation != status.incarnation:
                self._restarted(status)
            status.connected = True
            status.incarnation = event.incarnation
            status.last_sequence = event.sequence
            return
        status.missed += event.missed
        for sample in event.samples:
            self.fleet.record(status.endpoint, sample)
        status.samples += len(event.samples)
        if event.samples:
            status.last_sequence = event.samples[-1].sequence

    def _resync(self, status: EndpointStatus, err: EnginectlError) -> None:
        """OUT_OF_RANGE: the resume point is unusable; next time subscribe live."""
        status.resyncs += 1
        if err.reason == Reason.INCARNATION_CHANGED:
            self._restarted(status)
        status.incarnation, status.last_sequence = "", None

    def _restarted(self, status: EndpointStatus) -> None:
        status.restarts += 1
        self.fleet.forget(status.endpoint)


class PlannerThread:
    """A Planner on its own event loop in a daemon thread, for blocking callers.

    with PlannerThread(["127.0.0.1:50051"]) as planner:
        print(planner.reconcile({"worker-a"}, dp_size=1).verdict)
    """

    def __init__(
        self,
        endpoints: Sequence[str | ChannelConfig],
        *,
        stale_after: float = DEFAULT_STALE_AFTER_S,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL_S,
        backoff_max: float = DEFAULT_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoints = endpoints
        self._stale_after, self._backoff, self._clock = stale_after, (backoff_initial, backoff_max), clock
        self._loop: LoopThread | None = None
        self.planner: Planner | None = None

    def __enter__(self) -> PlannerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the loop thread and, on it, the planner."""
        self._loop = LoopThread("enginectl-planner")

        def make() -> Planner:
            planner = Planner(
                self._endpoints,
                stale_after=self._stale_after,
                backoff_initial=self._backoff[0],
                backoff_max=self._backoff[1],
                clock=self._clock,
            )
            planner.start()
            return planner

        self.planner = self._loop.call(make)

    def reconcile(
        self,
        expected_workers: Iterable[str] | Mapping[str, Collection[int]] | ExpectedRanks,
        dp_size: int | None = None,
    ) -> Reconciliation:
        """See Planner.reconcile (computed on the planner's loop, so it sees a consistent view)."""
        loop, planner = self._started()
        frozen = expected_workers if isinstance(expected_workers, (Mapping, ExpectedRanks)) else list(expected_workers)
        return loop.call(planner.reconcile, frozen, dp_size)

    def wait_for(self, predicate: Callable[[Planner], bool], timeout: float) -> bool:
        """See Planner.wait_for (`predicate` runs on the planner's loop)."""
        loop, planner = self._started()
        return loop.run(planner.wait_for(predicate, timeout), timeout + 5)

    def latest_ranks(self) -> list[RankState]:
        """The latest sample of every rank, read on the planner's loop (a consistent view);
        blocks until it is read."""
        loop, planner = self._started()
        return loop.call(planner.fleet.latest)

    def _started(self) -> tuple[LoopThread, Planner]:
        assert self._loop is not None and self.planner is not None, "start() first"
        return self._loop, self.planner

    def close(self) -> None:
        """Stop following the endpoints and stop the loop thread. Idempotent."""
        if self._loop is None or self._loop.closed:
            return
        try:
            if self.planner is not None:
                self._loop.run(self.planner.close(), 30)
        finally:
            self._loop.close()


def latest_ranks(planner: PlannerThread) -> list[RankState]:
    """The latest sample of every rank `planner` follows, read on its loop (a consistent view);
    blocks until it is read (Fleet.status calls it off its own loop)."""
    return planner.latest_ranks()
