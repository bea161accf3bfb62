"""The soak's stream subscribers (bench/soak/run.py): the lost-write watcher, and Watch and FPM
subscribers that come and go, all on one asyncio loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.soak.records import REQUEST_TIMEOUT_S, WORKER_ID, Errors
from enginectl.client import (
    AsyncClient,
    ChannelConfig,
    EnginectlError,
    FpmBatch,
    FpmProgress,
    OutOfRangeError,
    Reason,
    SampleKind,
    WeightVersion,
)
from enginectl.client.fpm import stream_forward_pass_metrics, stream_request

T = TypeVar("T")


# -- streams: the lost-write watcher, Watch and FPM subscribers that come and go ---------------
@dataclass
class WatchChurnStats:
    connects: int = 0
    states: int = 0
    declared_gaps: int = 0  # declared revisions skipped across resumes (must be 0)
    repeats: int = 0  # declared revisions seen twice
    resyncs: int = 0  # OUT_OF_RANGE answers (reported: re-read knowingly)
    last_revision: int | None = None


@dataclass
class FpmStats:
    name: str
    max_batch: int
    session_s: tuple[float, float]  # how long it reads before leaving (random in this range)
    stall_every: int = 0  # > 0: a slow reader, which stops reading for `stall_s` after so many samples
    stall_s: float = 0.0
    stalls: int = 0
    connects: int = 0
    resumes: int = 0
    samples: int = 0
    heartbeats: int = 0
    batches: int = 0
    missed_reported: int = 0
    gap_samples: int = 0  # sequence jumps explained by `missed`
    unreported_gap_samples: int = 0  # jumps no `missed` explains (must be 0)
    unreported_gap_events: int = 0
    out_of_order: int = 0
    other_worker: int = 0  # samples without worker_id "soak"
    evicted: int = 0  # SEQUENCE_EVICTED: told, then re-synced from the head
    resync_skipped: int = 0  # samples skipped knowingly after an eviction
    incarnation_changes: int = 0
    incarnation: str = ""
    last_sequence: int | None = None


class Streams:
    """Every stream subscriber of the soak, on one asyncio loop thread."""

    def __init__(self, target: str, errors: Errors) -> None:
        self.target, self.errors = target, errors
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="soak-streams", daemon=True)
        self.states: list[WeightVersion] = []
        self.watch_breaks = 0
        self._seen = threading.Condition()
        self.watch_churn = WatchChurnStats()
        # Engine steps make some 20-50 samples/s under the soak's load. While the slow reader
        # stalls, samples (~120 bytes each) fill the server's HTTP/2 write buffer (64 KiB), its
        # own receive window (1 KiB here, and no BDP probing, which would grow it to megabytes),
        # then its queue on the server (FPM_SUBSCRIBER_QUEUE): ~600 samples, so a 40 s stall
        # overflows them once it reads live (after a resume has replayed what it missed).
        self.fpm = [
            FpmStats("fpm-reader", max_batch=0, session_s=(2.0, 8.0)),
            FpmStats("fpm-slow-reader", max_batch=4, session_s=(50.0, 90.0), stall_every=300, stall_s=40.0),
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._recorder: asyncio.Task[None] | None = None

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        """Subscribe the watcher (returns once it holds the current state), then the others."""
        self._thread.start()

        async def begin() -> None:
            self._client = AsyncClient(self.target, timeout=REQUEST_TIMEOUT_S)
            self._stop = asyncio.Event()
            self._recorder = asyncio.ensure_future(self._record())

        self._run(begin(), 30)
        with self._seen:
            if not self._seen.wait_for(lambda: bool(self.states), 60):
                raise RuntimeError("WatchWeightVersion sent no current state within 60s")

        async def churners() -> None:
            self._tasks = [
                asyncio.ensure_future(self._churn_watch(random.Random(7))),
                *(asyncio.ensure_future(self._churn_fpm(s, random.Random(11 + i))) for i, s in enumerate(self.fpm)),
            ]

        self._run(churners(), 30)

    async def _record(self) -> None:
        """The lost-write watcher: every state, in order; resumes after a broken stream."""
        since: int | None = None
        while True:
            try:
                async for state in self._client.watch_weight_version(since_revision=since):
                    since = state.revision
                    with self._seen:
                        self.states.append(state)
                        self._seen.notify_all()
            except EnginectlError as err:
                self.errors.rpc("watch", err)
            self.watch_breaks += 1
            await asyncio.sleep(0.5)  # pacing the reconnect

    async def _read_for(self, coro: Coroutine[Any, Any, None], seconds: float) -> None:
        """Run a stream reader for `seconds` (or until the soak stops), then leave."""
        reader = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({reader, stopper}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not reader.done():
                reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _churn_watch(self, rng: random.Random) -> None:
        st = self.watch_churn
        since: int | None = None

        async def read() -> None:
            nonlocal since
            async for state in self._client.watch_weight_version(since_revision=since):
                st.states += 1
                since = state.revision
                if not state.declared:
                    continue
                if st.last_revision is not None:
                    if state.revision <= st.last_revision:
                        st.repeats += 1
                        continue
                    st.declared_gaps += state.revision - st.last_revision - 1
                st.last_revision = state.revision

        while not self._stop.is_set():
            st.connects += 1
            try:
                await self._read_for(read(), rng.uniform(1.0, 5.0))
            except OutOfRangeError:
                st.resyncs += 1
                since, st.last_revision = None, None
            except EnginectlError as err:
                self.errors.rpc("watch-churn", err)
            await self._pause(rng.uniform(0.2, 2.0))

    async def _churn_fpm(self, st: FpmStats, rng: random.Random) -> None:
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)] if st.stall_every else []
        channel = ChannelConfig(target=self.target, options=options).aio_channel()

        async def read(resume: int | None) -> None:
            budget = 0  # samples this subscription said it missed and no jump used yet
            first = True
            unstalled = 0
            request = stream_request(
                include_heartbeats=True,
                max_batch_size=st.max_batch,
                resume_after_sequence=resume,
                resume_incarnation=st.incarnation if resume is not None else "",
            )
            async for msg in stream_forward_pass_metrics(channel, request):
                if isinstance(msg, FpmProgress):
                    if first:
                        if st.incarnation and msg.incarnation != st.incarnation:
                            st.incarnation_changes += 1
                        st.incarnation = msg.incarnation
                        if resume is None:  # live from here: the next sample is after `sequence`
                            if st.last_sequence is not None:
                                st.resync_skipped += max(0, msg.sequence - st.last_sequence)
                            st.last_sequence = msg.sequence
                        first = False
                    continue
                assert isinstance(msg, FpmBatch)
                first = False
                st.batches += 1
                st.missed_reported += msg.missed
                budget += msg.missed
                for sample in msg.samples:
                    last = st.last_sequence if st.last_sequence is not None else sample.sequence - 1
                    jump = sample.sequence - last - 1
                    if jump < 0:
                        st.out_of_order += 1
                        continue
                    explained = min(jump, budget)
                    budget -= explained
                    st.gap_samples += explained
                    if jump > explained:
                        st.unreported_gap_samples += jump - explained
                        st.unreported_gap_events += 1
                    st.last_sequence = sample.sequence
                    st.samples += 1
                    st.heartbeats += sample.kind == SampleKind.HEARTBEAT
                    st.other_worker += sample.worker_id != WORKER_ID
                unstalled += len(msg.samples)
                if st.stall_every and unstalled >= st.stall_every:
                    st.stalls += 1
                    unstalled = 0
                    await asyncio.sleep(st.stall_s)  # a slow reader, on purpose

        try:
            while not self._stop.is_set():
                resume = st.last_sequence if st.incarnation and st.last_sequence is not None else None
                st.connects += 1
                st.resumes += resume is not None
                try:
                    await self._read_for(read(resume), rng.uniform(*st.session_s))
                except OutOfRangeError as err:
                    if err.reason != Reason.SEQUENCE_EVICTED:
                        self.errors.rpc(st.name, err)
                    st.evicted += 1
                    st.incarnation = ""  # subscribe afresh from the head
                except EnginectlError as err:
                    self.errors.rpc(st.name, err)
                await self._pause(rng.uniform(0.2, 2.0))
        finally:
            await channel.close()

    def stop_subscribers(self, timeout: float = 30.0) -> None:
        async def stop() -> None:
            self._stop.set()
            await asyncio.wait(self._tasks, timeout=timeout)

        self._run(stop(), timeout + 5)

    def wait_for_etag(self, etag: str, timeout: float) -> bool:
        """Whether the watcher saw the state with `etag` within `timeout`."""
        with self._seen:
            return self._seen.wait_for(lambda: any(s.etag == etag for s in self.states[-50:]), timeout)

    def close(self) -> None:
        async def end() -> None:
            for task in [*self._tasks, *([self._recorder] if self._recorder else [])]:
                task.cancel()
            await asyncio.gather(*self._tasks, *([self._recorder] if self._recorder else []), return_exceptions=True)
            await self._client.close()

        # Closing whatever exists (start may have failed half-way): never hide the run's result.
        with contextlib.suppress(Exception):
            self._run(end(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
