"""`python -m bench.soak` (`make soak`): a bounded soak of one real `enginectl serve`.

Not part of `make test` or CI. Runs in its own process; everything is on 127.0.0.1. One
`enginectl serve --enable-scale-out --worker-id soak --allow-weights-from <tmp dir>` on the
embedded tiny model (started and stopped by bench/procs.py) gets, for `--duration` seconds
(default 600), all at once:

- rollouts: 2-4 threads looping `POST /inference/v1/generate` on vLLM's HTTP API, prompts of
  3-150 random token ids, max_tokens 1-11, temperature 0, one keep-alive connection each;
- weight updates back to back, rotating disk / tensor stream / gloo broadcast and the two
  checkpoints A and B, each with a weight_version, each followed by a declaration
  (SetWeightVersion without etag), and a VerifyWeights after every full rotation. Disk
  updates go from this process; tensor-stream and gloo updates from a trainer subprocess
  (bench/soak_trainer.py, which also builds the checkpoints: torch stays out of here);
- 2 CAS writers looping GetWeightVersion -> SetWeightVersion(etag);
- one WeightVersion watcher subscribed before anything starts, which must see every
  acknowledged write exactly once with consecutive revisions (lost writes: 0);
- a Watch subscriber and two FPM subscribers (one deliberately slow) that read a while,
  leave and resume (since_revision; resume_after_sequence + resume_incarnation), counting
  every sequence jump that no `missed` count explains (unreported gaps: 0);
- RSS, open fds and threads of the server and each of its child processes (psutil), at
  start, after the warm-up (`--warmup` of the duration) and at the end, taken between two
  updates; every `SAMPLE_INTERVAL_S` for the time series.

It fails (exit 1, naming each failed check) on growth from after-warm-up to the end beyond
the bounds below, on lost writes, on unreported FPM or Watch gaps, on the engine dying, on
any UNKNOWN/INTERNAL status (or HTTP 5xx), and on any other unexpected error. Writes
bench/results/soak/latest.json and latest.md. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from bench.harness import ServeProcess
from bench.procs import Worker, enginectl_server
from bench.run import HTTP_STARTUP_LINE, log, machine_info, repo_info, wait_http_ready
from bench.stats import summarize_ms
from enginectl.client import (
    AbortedError,
    AsyncClient,
    ChannelConfig,
    Client,
    EnginectlError,
    FpmBatch,
    FpmProgress,
    OutOfRangeError,
    Reason,
    SampleKind,
    TrainerClient,
    WeightVersion,
)
from enginectl.client.fpm import stream_forward_pass_metrics, stream_request

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "soak"
WORKER_ID = "soak"
SOURCES = ("disk", "tensors", "gloo")
# What vLLM's EngineCore stamps on outputs until a version is handed to it (its
# `_weight_version` starts as "default"): rollouts that ran before the first declaration carry
# it. The soak never declares it, so it is counted apart from versions nobody declared.
VLLM_PLACEHOLDER = "default"
# Each FPM subscriber's queue on the soak's server (`--fpm-subscriber-queue`, default 4,096):
# small, so that the slow reader below overflows it within a session and the `missed`
# accounting is exercised; the fast reader drains it as samples arrive.
FPM_SUBSCRIBER_QUEUE = 64
CHECKPOINTS = ("B", "A")  # the server starts on A's weights: the first update changes them
SAMPLE_INTERVAL_S = 10.0
UPDATE_TIMEOUT_S = 120.0  # bound of each update (the server's `timeout`, and our wait)
REQUEST_TIMEOUT_S = 120.0  # one rollout, one unary RPC
CAS_PAUSE_S = 0.02  # upper bound of a CAS writer's random pause between rounds (its pace)
MIB = 1 << 20

# Growth bounds, per process, from the sample after warm-up to the one at the end (both under
# the same load and both taken between two updates, so no update's transient buffers, gloo
# group or stream is counted). By the end of warm-up the engine has compiled, its caches are
# in use, the thread pools have grown, and the vLLM worker process has made the climb its RSS
# makes over its first few hundred updates (about +450 MiB here, flat afterwards: allocator
# arenas and the CPU backend's repacked weights; a 20% warm-up of the default 10 minutes
# covers it, runs under ~5 minutes need `--warmup 0.5`). What is left is allocator noise,
# which moves a ~600 MB Python process by tens of MiB, and bounded structures still filling
# (the FPM ring of 10,000 samples, the ledger's 10,000 remembered request ids: ~20 MB at
# most). A leak per update is caught either way: one copy of the tiny model's weights
# (~1.8 MB) kept per update exceeds 64 MiB within ~35 of the thousands of updates a default
# run makes; one socket or thread kept per update (e.g. per gloo group) exceeds +16 fds / +8
# threads within a few rotations. Thread pools that grow on demand (asyncio's default
# executor: cpu_count + 4) are why threads get some slack.
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_FLOOR = 64 * MIB
FD_GROWTH = 16
THREAD_GROWTH = 8


# -- shared records ----------------------------------------------------------------------------
class Errors:
    """Every failed call, by (where, code, reason); the first messages of each kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def add(self, where: str, code: str, reason: str = "", message: str = "") -> None:
        key = f"{where} {code}{' ' + reason if reason else ''}"
        with self._lock:
            self.counts[key] += 1
            self.examples.setdefault(key, message[:300])

    def rpc(self, where: str, err: EnginectlError) -> None:
        self.add(where, err.code.name, err.reason, err.message)

    def internal(self) -> int:
        """UNKNOWN / INTERNAL statuses and HTTP 5xx: a server fault, never an expected outcome."""
        return sum(
            n
            for k, n in self.counts.items()
            if k.split()[1] in ("UNKNOWN", "INTERNAL") or k.split()[1].startswith("HTTP_5")
        )

    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Write:
    """An acknowledged write of the version: what the server answered."""

    kind: str  # cas, decl, disk, tensors, gloo
    version: str
    revision: int


class Writes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[Write] = []

    def add(self, kind: str, version: str, revision: int) -> None:
        with self._lock:
            self.items.append(Write(kind, version, revision))

    def add_state(self, kind: str, state: WeightVersion) -> None:
        self.add(kind, state.version or "", state.revision)


@dataclass
class Snapshot:
    """Resources of the server process and its descendants at one moment."""

    label: str
    t_s: float
    during_update: bool
    processes: list[dict[str, Any]]
    updates: int = 0  # weight updates done when it was taken

    def total(self, key: str) -> int:
        return sum(int(p[key]) for p in self.processes)


def process_role(proc: psutil.Process, server_pid: int) -> str:
    if proc.pid == server_pid:
        return "serve"
    try:
        text = " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return "?"
    for role in ("EngineCore", "resource_tracker", "Worker"):
        if role in text:
            return role
    return proc.name()


def snapshot(server: ServeProcess, label: str, t0: float, during_update: bool = False) -> Snapshot:
    try:
        root = psutil.Process(server.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    rows = []
    for p in procs:
        try:
            with p.oneshot():
                rows.append(
                    {
                        "pid": p.pid,
                        "role": process_role(p, server.pid),
                        "rss_mib": round(p.memory_info().rss / MIB, 1),
                        "fds": p.num_fds(),
                        "threads": p.num_threads(),
                    }
                )
        except psutil.Error:
            continue
    return Snapshot(label, round(time.monotonic() - t0, 1), during_update, rows)


# -- rollouts ----------------------------------------------------------------------------------
@dataclass
class RolloutStats:
    requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    unstamped: int = 0  # outputs without weight_versions
    placeholder: int = 0  # outputs naming VLLM_PLACEHOLDER (generated before any declaration)
    multi_version: int = 0  # outputs generated across an update (several versions)
    versions: set[str] = field(default_factory=set)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (t since start, seconds)


def rollout_loop(
    port: int,
    vocab: int,
    seed: int,
    stop: threading.Event,
    deadline: float,
    max_requests: int,
    t0: float,
    stats: RolloutStats,
    lock: threading.Lock,
    errors: Errors,
) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        for _ in range(max_requests):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 150))]
            body = json.dumps(
                {"token_ids": prompt, "sampling_params": {"max_tokens": rng.randint(1, 11), "temperature": 0.0}}
            )
            started = time.monotonic()
            with lock:
                stats.requests += 1
            try:
                conn.request("POST", "/inference/v1/generate", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                errors.add("rollout", type(exc).__name__, message=str(exc))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
                continue
            if resp.status != 200:
                errors.add("rollout", f"HTTP_{resp.status}", message=data[:300].decode(errors="replace"))
                continue
            choice = json.loads(data)["choices"][0]
            spans = choice.get("weight_versions") or []
            with lock:
                stats.completed += 1
                stats.prompt_tokens += len(prompt)
                stats.output_tokens += len(choice.get("token_ids") or [])
                stats.latencies.append((round(started - t0, 3), time.monotonic() - started))
                stats.unstamped += not spans
                stats.multi_version += len(spans) > 1
                stats.versions.update(s["version"] for s in spans if s.get("version"))
                stats.placeholder += any(s.get("version") == VLLM_PLACEHOLDER for s in spans)
    finally:
        conn.close()


# -- CAS writers -------------------------------------------------------------------------------
@dataclass
class CasStats:
    rounds: int = 0
    succeeded: int = 0
    etag_mismatch: int = 0


def cas_loop(
    target: str,
    index: int,
    stop: threading.Event,
    deadline: float,
    max_rounds: int,
    stats: CasStats,
    lock: threading.Lock,
    writes: Writes,
    errors: Errors,
) -> None:
    rng = random.Random(1000 + index)
    with Client(target, timeout=REQUEST_TIMEOUT_S) as client:
        for i in range(max_rounds):
            if stop.is_set() or time.monotonic() >= deadline:
                break
            with lock:
                stats.rounds += 1
            try:
                current = client.get_weight_version()
                state = client.set_weight_version(f"cas-{index}-{i}", etag=current.etag)
            except AbortedError as err:
                if err.reason != Reason.ETAG_MISMATCH:
                    errors.rpc("cas", err)
                    continue
                with lock:
                    stats.etag_mismatch += 1
            except EnginectlError as err:
                errors.rpc("cas", err)
            else:
                writes.add_state("cas", state)
                with lock:
                    stats.succeeded += 1
            stop.wait(rng.uniform(0.0, CAS_PAUSE_S))


# -- weight updates ----------------------------------------------------------------------------
@dataclass
class UpdateStats:
    ok: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    declarations: int = 0
    declarations_failed: int = 0
    verify: Counter[str] = field(default_factory=Counter)
    wall_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})
    server_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})


class Updater:
    """Back-to-back updates, rotating the sources and checkpoints; holds `lock` during each
    step so that resource snapshots fall between two updates."""

    def __init__(
        self,
        target: str,
        trainer: Worker,
        checkpoints: dict[str, str],
        sources: tuple[str, ...],
        writes: Writes,
        errors: Errors,
    ) -> None:
        self.target, self.trainer, self.checkpoints, self.sources = target, trainer, checkpoints, sources
        self.writes, self.errors = writes, errors
        self.lock = threading.Lock()
        self.stats = UpdateStats()

    def _disk(self, client: TrainerClient, which: str, version: str) -> dict[str, Any]:
        try:
            result = client.update_weights_from_disk(self.checkpoints[which], version, timeout=UPDATE_TIMEOUT_S)
        except EnginectlError as err:
            return {"ok": False, "stage": "disk", "code": err.code.name, "reason": err.reason, "message": err.message}
        v = result.weight_version
        return {"ok": True, "revision": v.revision, "version": v.version, "server_s": result.duration}

    def _child(self, op: str, which: str, version: str) -> dict[str, Any]:
        """An update sent by the trainer subprocess (raises if it died or hung)."""
        self.trainer.send(json.dumps({"op": op, "which": which, "version": version}))
        return self.trainer.expect("done", UPDATE_TIMEOUT_S + 90)

    def _step(self, client: TrainerClient, n: int) -> None:
        source, which = self.sources[n % len(self.sources)], CHECKPOINTS[n % len(CHECKPOINTS)]
        version = f"soak-{source}-{n}"
        started = time.monotonic()
        out = self._disk(client, which, version) if source == "disk" else self._child(source, which, version)
        if out["ok"]:
            self.stats.ok[source] += 1
            self.stats.wall_s[source].append(time.monotonic() - started)
            self.stats.server_s[source].append(float(out["server_s"]))
            self.writes.add(source, out["version"], int(out["revision"]))
        else:
            self.stats.failed[source] += 1
            self.errors.add(f"update-{source}", out["code"], out["reason"], out["message"])
            if out["reason"] in (Reason.PARTIAL_UPDATE, Reason.UPDATE_TIMEOUT, Reason.STREAM_BROKEN):
                # Left paused over mixed weights (README, Weight updates): the next update
                # resumes; resume now so that rollouts keep running meanwhile.
                with contextlib.suppress(EnginectlError):
                    client.resume_generation(force=True)
        try:
            self.writes.add_state("decl", client.set_weight_version(f"soak-decl-{n}"))
            self.stats.declarations += 1
        except EnginectlError as err:
            self.stats.declarations_failed += 1
            self.errors.rpc("declare", err)
        if n % len(self.sources) == len(self.sources) - 1:
            try:
                self.stats.verify[client.verify_weights().verdict] += 1
            except EnginectlError as err:
                self.errors.rpc("verify", err)

    def run(self, stop: threading.Event, deadline: float, max_updates: int) -> None:
        with TrainerClient(self.target, timeout=REQUEST_TIMEOUT_S) as client:
            for n in range(max_updates):
                if stop.is_set() or time.monotonic() >= deadline:
                    break
                with self.lock:
                    try:
                        self._step(client, n)
                    except (RuntimeError, OSError) as exc:  # the trainer subprocess died or hung
                        self.errors.add("updater", type(exc).__name__, message=str(exc))
                        break


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


# -- verification ------------------------------------------------------------------------------
def verify_writes(writes: list[Write], states: list[WeightVersion]) -> dict[str, Any]:
    """Every acknowledged write must appear exactly once among the watched declared states,
    under its revision and version, and the watched revisions must be consecutive."""
    declared = [s for s in states if s.declared]
    by_revision: dict[int, list[str]] = {}
    for s in declared:
        by_revision.setdefault(s.revision, []).append(s.version or "")
    missing = [w for w in writes if by_revision.get(w.revision, []).count(w.version) != 1]
    duplicated = sorted(r for r, vs in by_revision.items() if len(vs) > 1)
    revisions = sorted(by_revision)
    gaps = (revisions[-1] - revisions[0] + 1 - len(revisions)) if revisions else 0
    acked = {(w.revision, w.version) for w in writes}
    unacknowledged = [r for r, vs in by_revision.items() for v in vs if (r, v) not in acked]
    return {
        "acknowledged_writes": len(writes),
        "by_kind": dict(Counter(w.kind for w in writes)),
        "watched_states": len(states),
        "watched_declared": len(declared),
        "first_revision": revisions[0] if revisions else None,
        "last_revision": revisions[-1] if revisions else None,
        "missing": len(missing),
        "missing_examples": [asdict(w) for w in missing[:5]],
        "duplicated_revisions": len(duplicated),
        "revision_gaps": gaps,
        "unacknowledged": len(unacknowledged),  # watched but never acknowledged (e.g. a lost reply)
        "lost_writes": len(missing) + len(duplicated) + gaps,
    }


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None with fewer than 3."""
    if len(points) < 3:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def growth(before: Snapshot, after: Snapshot, series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process present in both: growth, whether it is within the bounds above, and the RSS
    trend over the series samples between them (MiB per minute, over all of them and over the
    last half: a trend that flattens is a cache filling, one that does not is a leak)."""
    prev = {p["pid"]: p for p in before.processes}
    rows = []
    for p in after.processes:
        b = prev.get(p["pid"])
        if b is None:
            continue
        rss = (p["rss_mib"] - b["rss_mib"]) * MIB
        rss_bound = max(RSS_GROWTH_FLOOR, RSS_GROWTH_FRACTION * b["rss_mib"] * MIB)
        key = f"{p['role']} {p['pid']}"
        trend = [
            (s["t_s"] / 60, s["rss_mib"][key])
            for s in series
            if before.t_s <= s["t_s"] <= after.t_s and key in s["rss_mib"]
        ]
        whole, last = slope(trend), slope(trend[len(trend) // 2 :])
        updates = after.updates - before.updates
        rows.append(
            {
                "pid": p["pid"],
                "role": p["role"],
                "rss_mib": round(rss / MIB, 1),
                "rss_bound_mib": round(rss_bound / MIB, 1),
                "fds": p["fds"] - b["fds"],
                "threads": p["threads"] - b["threads"],
                "rss_mib_per_min": None if whole is None else round(whole, 2),
                "rss_mib_per_min_last_half": None if last is None else round(last, 2),
                "rss_kib_per_update": round(rss / 1024 / updates, 1) if updates else None,
                "ok": rss <= rss_bound
                and p["fds"] - b["fds"] <= FD_GROWTH
                and p["threads"] - b["threads"] <= THREAD_GROWTH,
            }
        )
    return rows


def guarded(name: str, errors: Errors, fn: Callable[..., None], *args: Any) -> threading.Thread:
    """A daemon thread running `fn(*args)`; a crash is recorded as an error, never lost."""

    def body() -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.add(name, "CRASHED", type(exc).__name__, repr(exc))

    return threading.Thread(target=body, name=name, daemon=True)


def check(name: str, value: Any, bound: str, ok: bool, detail: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "bound": bound, "ok": ok, "detail": detail}


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Soak:
    duration: float
    warmup: float
    rollouts: int
    sources: tuple[str, ...]
    errors: Errors = field(default_factory=Errors)
    writes: Writes = field(default_factory=Writes)
    deaths: list[str] = field(default_factory=list)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)

    def alive(self, server: ServeProcess, start: Snapshot, dead_line: threading.Event) -> bool:
        """Whether the server and every process it had at start are still running."""
        if server.proc is None or server.proc.poll() is not None:
            self.deaths.append(f"enginectl serve exited with {server.proc.returncode if server.proc else None}")
            return False
        for p in start.processes:
            if p["role"] == "EngineCore" and not psutil.pid_exists(p["pid"]):
                self.deaths.append(f"EngineCore pid {p['pid']} exited")
                return False
        if dead_line.is_set():
            self.deaths.append("the server logged EngineDeadError")
            return False
        return True

    def take(self, server: ServeProcess, label: str, t0: float, updater: Updater | None) -> Snapshot:
        """A snapshot between two updates (waits for the one running, bounded)."""
        held = updater is not None and updater.lock.acquire(timeout=UPDATE_TIMEOUT_S + 30)
        try:
            snap = snapshot(server, label, t0, during_update=updater is not None and not held)
            snap.updates = sum(updater.stats.ok.values()) if updater is not None else 0
        finally:
            if held and updater is not None:
                updater.lock.release()
        self.snapshots[label] = snap
        log(
            f"{label}: "
            + ", ".join(f"{p['role']} {p['rss_mib']} MiB {p['fds']} fds {p['threads']} threads" for p in snap.processes)
        )
        return snap

    def run(self) -> dict[str, Any]:
        t_begin = time.monotonic()
        root = Path(tempfile.mkdtemp(prefix="enginectl-soak-"))
        server = enginectl_server(
            [
                "--enable-scale-out",
                "--worker-id",
                WORKER_ID,
                "--allow-weights-from",
                str(root),
                "--fpm-subscriber-queue",
                str(FPM_SUBSCRIBER_QUEUE),
            ]
        )
        server.name = "enginectl-soak"
        startup_line = server.watch(HTTP_STARTUP_LINE)
        dead_line = server.watch(b"EngineDeadError")
        results: dict[str, Any] = {
            "machine": machine_info(),
            "repo": repo_info(),
            "config": {
                "duration_s": self.duration,
                "warmup_s": self.warmup,
                "rollout_threads": self.rollouts,
                "cas_writers": 2,
                "sources": list(self.sources),
                "fpm_subscriber_queue": FPM_SUBSCRIBER_QUEUE,
                "sample_interval_s": SAMPLE_INTERVAL_S,
                "update_timeout_s": UPDATE_TIMEOUT_S,
            },
        }
        trainer: Worker | None = None
        streams: Streams | None = None
        threads: list[threading.Thread] = []
        stop = threading.Event()
        try:
            log("starting enginectl serve")
            server.start()
            server.wait_ready()
            results["http_ready"] = wait_http_ready(server, startup_line)
            target, model = server.grpc_target, str(server.serving["model"])
            results["server"] = {k: server.serving.get(k) for k in ("model", "dp_size", "grpc_port", "http_port")}
            vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
            log(f"serving on {target}; building checkpoints A and B under {root}")
            trainer = Worker(
                ["--target", target, "--model", model, "--root", str(root), "--timeout", str(UPDATE_TIMEOUT_S)],
                module="bench.soak_trainer",
            )
            ready = trainer.expect("ready", 300)
            results["checkpoints"] = {"tensors": ready["tensors"], "bytes": ready["bytes"]}

            t0 = time.monotonic()
            start = self.take(server, "start", t0, None)
            streams = Streams(target, self.errors)
            streams.start()
            updater = Updater(target, trainer, ready["checkpoints"], self.sources, self.writes, self.errors)
            deadline = t0 + self.duration
            rollouts, r_lock = RolloutStats(), threading.Lock()
            cas, c_lock = CasStats(), threading.Lock()
            bound = int(self.duration * 200) + 100  # far above any rate here: time ends the loops
            threads = [
                *(
                    guarded(
                        f"rollout-{i}",
                        self.errors,
                        rollout_loop,
                        server.http_port,
                        vocab,
                        i,
                        stop,
                        deadline,
                        bound,
                        t0,
                        rollouts,
                        r_lock,
                        self.errors,
                    )
                    for i in range(self.rollouts)
                ),
                *(
                    guarded(
                        f"cas-{i}",
                        self.errors,
                        cas_loop,
                        target,
                        i,
                        stop,
                        deadline,
                        bound,
                        cas,
                        c_lock,
                        self.writes,
                        self.errors,
                    )
                    for i in range(2)
                ),
                guarded("updater", self.errors, updater.run, stop, deadline, bound),
            ]
            for t in threads:
                t.start()
            log(f"load running for {self.duration:.0f}s (warm-up {self.warmup:.0f}s)")

            warm_at, next_sample = t0 + self.warmup, t0
            while not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    break
                if not self.alive(server, start, dead_line):
                    log(f"engine died: {self.deaths[-1]}")
                    break
                if now >= next_sample:
                    s = snapshot(server, "series", t0)
                    self.series.append(
                        {
                            "t_s": s.t_s,
                            "rss_mib": {f"{p['role']} {p['pid']}": p["rss_mib"] for p in s.processes},
                            "fds": s.total("fds"),
                            "threads": s.total("threads"),
                            "rollouts": rollouts.completed,
                            "updates": sum(updater.stats.ok.values()),
                            "cas": cas.succeeded,
                            "errors": self.errors.total(),
                        }
                    )
                    log(
                        f"t={s.t_s:.0f}s rollouts {rollouts.completed}, updates {dict(updater.stats.ok)}, "
                        f"cas {cas.succeeded}/{cas.rounds}, errors {self.errors.total()}"
                    )
                    next_sample += SAMPLE_INTERVAL_S
                if "after_warmup" not in self.snapshots and now >= warm_at:
                    self.take(server, "after_warmup", t0, updater)
                wake = [deadline, next_sample, *([warm_at] if "after_warmup" not in self.snapshots else [])]
                stop.wait(max(0.0, min(wake) - time.monotonic()))
            engine_ok = not self.deaths and self.alive(server, start, dead_line)
            if engine_ok:
                self.take(server, "end", t0, updater)
            stop.set()
            for t in threads:
                t.join(UPDATE_TIMEOUT_S + 120)
            results["stuck_threads"] = [t.name for t in threads if t.is_alive()]
            streams.stop_subscribers()
            if engine_ok:
                with Client(target) as client:
                    final = client.get_weight_version()
                results["watch_caught_up"] = streams.wait_for_etag(final.etag, 60)
                results["final_revision"] = final.revision
                self.take(server, "idle_end", t0, updater)
            streams.close()
            results["load_s"] = round(time.monotonic() - t0, 1)
            results["rollouts"] = rollout_summary(rollouts, self.warmup)
            watched = {s.version for s in streams.states if s.version}
            results["rollouts"]["unknown_versions"] = sorted(rollouts.versions - watched - {VLLM_PLACEHOLDER})
            results["cas"] = asdict(cas)
            results["updates"] = update_summary(updater.stats)
            results["writes"] = verify_writes(self.writes.items, streams.states)
            results["watch"] = {"breaks": streams.watch_breaks, "churn": asdict(streams.watch_churn)}
            results["fpm"] = [asdict(s) for s in streams.fpm]
        except Exception as exc:  # noqa: BLE001 - the run failed before its end: say why in the results
            log(f"soak aborted: {exc!r}")
            results["crash"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            stop.set()
            if streams is not None and streams.loop.is_running():
                streams.close()
            if trainer is not None:
                results["trainer_exit"] = trainer.finish()
            results["server_stop"] = server.stop()
            shutil.rmtree(root, ignore_errors=True)
        results["errors"] = {"counts": dict(self.errors.counts), "examples": self.errors.examples}
        results["deaths"] = self.deaths
        results["snapshots"] = {k: asdict(v) for k, v in self.snapshots.items()}
        results["series"] = self.series
        results["elapsed_s"] = round(time.monotonic() - t_begin, 1)
        results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        results["checks"] = self.checks(results)
        results["passed"] = all(c["ok"] for c in results["checks"])
        return results

    def checks(self, r: dict[str, Any]) -> list[dict[str, Any]]:
        dead = sum(n for k, n in self.errors.counts.items() if Reason.ENGINE_DEAD in k)
        out: list[dict[str, Any]] = [
            check("soak ran to its end", r.get("crash", "yes"), "no exception", "crash" not in r),
            check(
                "engine alive",
                "died: " + "; ".join(self.deaths) if self.deaths else "yes",
                "alive to the end",
                not self.deaths and not dead,
                f"{dead} ENGINE_DEAD answers" if dead else "",
            ),
        ]
        warm, end = self.snapshots.get("after_warmup"), self.snapshots.get("end")
        if warm is not None and end is not None:
            rows = growth(warm, end, self.series)
            bad = [g for g in rows if not g["ok"]]
            out.append(
                check(
                    "resource growth after warm-up",
                    rows,
                    f"per process: RSS <= max({RSS_GROWTH_FLOOR // MIB} MiB, "
                    f"{RSS_GROWTH_FRACTION:.0%}), fds <= +{FD_GROWTH}, threads <= +{THREAD_GROWTH}",
                    not bad,
                    "; ".join(
                        f"{g['role']} pid {g['pid']}: RSS {g['rss_mib']:+} MiB, "
                        f"fds {g['fds']:+}, threads {g['threads']:+}"
                        for g in bad
                    ),
                )
            )
            gone = {p["pid"] for p in warm.processes} - {p["pid"] for p in end.processes}
            new = {p["pid"]: p["role"] for p in end.processes if p["pid"] not in {q["pid"] for q in warm.processes}}
            out.append(
                check(
                    "server processes after warm-up",
                    {"gone": sorted(gone), "new": new},
                    "the same processes",
                    not gone and not new,
                )
            )
        else:
            out.append(
                check(
                    "resource growth after warm-up",
                    None,
                    "samples after warm-up and at the end",
                    False,
                    "the run ended before both samples were taken",
                )
            )
        w: dict[str, Any] = r.get("writes") or {}
        out.append(
            check(
                "lost writes",
                w.get("lost_writes"),
                "0",
                w.get("lost_writes") == 0 and bool(r.get("watch_caught_up")),
                "" if r.get("watch_caught_up") else "the watcher never saw the final state",
            )
        )
        churn = r.get("watch", {}).get("churn", {})
        out.append(check("Watch resume gaps", churn.get("declared_gaps"), "0", churn.get("declared_gaps") == 0))
        fpm = r.get("fpm", [])
        gaps = sum(s["unreported_gap_samples"] + s["out_of_order"] for s in fpm)
        out.append(
            check(
                "FPM gaps not reported as missed",
                gaps,
                "0",
                bool(fpm) and gaps == 0,
                "; ".join(
                    f"{s['name']}: {s['unreported_gap_events']} jumps, {s['out_of_order']} out of order"
                    for s in fpm
                    if s["unreported_gap_samples"] or s["out_of_order"]
                ),
            )
        )
        other = sum(s["other_worker"] + s["incarnation_changes"] for s in fpm)
        out.append(check("FPM identity and incarnation", other, "0", other == 0))
        internal = self.errors.internal()
        out.append(check("UNKNOWN/INTERNAL statuses (and HTTP 5xx)", internal, "0", internal == 0))
        unexpected = self.errors.total()
        out.append(
            check(
                "unexpected errors (any status but CAS ETAG_MISMATCH)",
                unexpected,
                "0",
                unexpected == 0,
                "; ".join(f"{k}: {n}" for k, n in self.errors.counts.items()),
            )
        )
        ro = r.get("rollouts", {})
        stale = ro.get("unknown_versions", [])
        out.append(check("rollout versions never declared", len(stale), "0", not stale, ", ".join(stale[:5])))
        up = r.get("updates", {})
        every = all(up.get("ok", {}).get(s, 0) > 0 for s in self.sources) and ro.get("completed", 0) > 0
        out.append(check("every source updated, rollouts completed", up.get("ok"), ">= 1 each", every))
        drift = {k: n for k, n in up.get("verify", {}).items() if k != "MATCH"}
        out.append(check("VerifyWeights after updates", up.get("verify"), "MATCH", not drift))
        stuck = r.get("stuck_threads", [])
        out.append(check("load loops stopped", stuck, "none left running", not stuck))
        stop = r.get("server_stop", {})
        out.append(
            check(
                "server stop",
                {k: stop.get(k) for k in ("exit_code", "children_left")},
                "exit 0, no child left",
                stop.get("exit_code") == 0 and not stop.get("children_left"),
            )
        )
        return out


def rollout_summary(st: RolloutStats, warmup: float) -> dict[str, Any]:
    lat = st.latencies
    return {
        "requests": st.requests,
        "completed": st.completed,
        "prompt_tokens": st.prompt_tokens,
        "output_tokens": st.output_tokens,
        "unstamped": st.unstamped,
        "multi_version": st.multi_version,
        "placeholder": st.placeholder,
        "versions_seen": len(st.versions),
        "latency_warmup": summarize_ms([s for t, s in lat if t < warmup]),
        "latency_after_warmup": summarize_ms([s for t, s in lat if t >= warmup]),
    }


def update_summary(st: UpdateStats) -> dict[str, Any]:
    return {
        "ok": dict(st.ok),
        "failed": dict(st.failed),
        "declarations": st.declarations,
        "declarations_failed": st.declarations_failed,
        "verify": dict(st.verify),
        "wall": {s: summarize_ms(v) for s, v in st.wall_s.items()},
        "server": {s: summarize_ms(v) for s, v in st.server_s.items()},
    }


# -- report ------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def markdown(r: dict[str, Any]) -> str:
    m, c = r["machine"], r["config"]
    weights_mb = r.get("checkpoints", {}).get("bytes", 0) / 1e6
    dirty = " + uncommitted changes" if r["repo"]["dirty"] else ""
    lines = [
        f"# enginectl soak — {m['date']}",
        "",
        (
            f"{c['duration_s']:.0f} s of load ({c['warmup_s']:.0f} s warm-up) on one `enginectl serve` (embedded "
            f"tiny model, {weights_mb:.1f} MB of weights); {m['nproc']} cores, load avg {m['loadavg_start']} -> "
            f"{m.get('loadavg_end')}; vLLM {m['vllm']}; commit {r['repo']['commit']}{dirty}. "
            f"Result: **{'PASSED' if r['passed'] else 'FAILED'}**."
        ),
        "",
        "| check | value | bound | ok |",
        "|---|---|---|---|",
    ]
    for ch in r["checks"]:
        value, detail = ch["value"], f" ({ch['detail']})" if ch["detail"] else ""
        if ch["name"] == "resource growth after warm-up" and isinstance(value, list):
            value = "; ".join(
                f"{g['role']}: RSS {g['rss_mib']:+} MiB ({g['rss_mib_per_min']} MiB/min, last half "
                f"{g['rss_mib_per_min_last_half']}), fds {g['fds']:+}, threads {g['threads']:+}"
                for g in value
            )
            detail = ""
        lines.append(f"| {ch['name']} | {value}{detail} | {ch['bound']} | {'yes' if ch['ok'] else '**no**'} |")

    snaps = r.get("snapshots", {})
    labels = [k for k in ("start", "after_warmup", "end", "idle_end") if k in snaps]
    if labels:
        lines += ["", "Resources (RSS MiB / open fds / threads; `end` under load, `idle_end` after it stopped):", ""]
        lines.append("| process | " + " | ".join(f"{k} (t={snaps[k]['t_s']:.0f}s)" for k in labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
        names: dict[int, str] = {}
        for k in labels:
            for p in snaps[k]["processes"]:
                names.setdefault(p["pid"], f"{p['role']} ({p['pid']})")
        for pid, name in names.items():
            cells = []
            for k in labels:
                row = next((p for p in snaps[k]["processes"] if p["pid"] == pid), None)
                cells.append(f"{row['rss_mib']} / {row['fds']} / {row['threads']}" if row else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

    ro, up, cas, w = r.get("rollouts"), r.get("updates"), r.get("cas"), r.get("writes")
    if ro and up and cas and w:
        lat, churn = ro["latency_after_warmup"], r["watch"]["churn"]
        updates = ", ".join(
            f"{s} {up['ok'].get(s, 0)} ok / {up['failed'].get(s, 0)} failed (p50 {_ms(up['wall'][s].get('p50_ms'))} ms)"
            for s in SOURCES
            if s in up["ok"] or s in up["failed"]
        )
        lines += ["", "Activity:", ""]
        lines.append(
            f"- rollouts: {ro['completed']} completed of {ro['requests']} ({ro['prompt_tokens']} prompt / "
            f"{ro['output_tokens']} output tokens; {ro['multi_version']} generated across an update; "
            f"latency after warm-up p50 {_ms(lat.get('p50_ms'))} ms, p99 {_ms(lat.get('p99_ms'))} ms; "
            f"{ro['placeholder']} stamped `{VLLM_PLACEHOLDER}`, generated before the first declaration)"
        )
        lines.append(f"- weight updates: {updates}; declarations {up['declarations']}; VerifyWeights {up['verify']}")
        lines.append(
            f"- CAS writers: {cas['rounds']} rounds, {cas['succeeded']} succeeded, {cas['etag_mismatch']} ETAG_MISMATCH"
        )
        lines.append(
            f"- watched: {w['watched_declared']} declared states, revisions {w['first_revision']}.."
            f"{w['last_revision']}; {w['acknowledged_writes']} acknowledged writes {w['by_kind']}; "
            f"lost {w['lost_writes']} (missing {w['missing']}, duplicated {w['duplicated_revisions']}, "
            f"gaps {w['revision_gaps']}); unacknowledged {w['unacknowledged']}"
        )
        lines.append(
            f"- Watch churn: {churn['connects']} connects, {churn['states']} states, "
            f"{churn['declared_gaps']} gaps, {churn['resyncs']} re-syncs"
        )
        for s in r.get("fpm", []):
            lines.append(
                f"- {s['name']}: {s['connects']} connects ({s['resumes']} resumes), {s['samples']} "
                f"samples ({s['heartbeats']} heartbeats), {s.get('stalls', 0)} stalls, missed "
                f"{s['missed_reported']} (reported), unreported gaps {s['unreported_gap_samples']}, "
                f"evicted {s['evicted']}"
            )
    if r.get("errors", {}).get("counts"):
        lines += ["", "Errors:", ""]
        lines += [f"- {k}: {n} (e.g. {r['errors']['examples'].get(k, '')!r})" for k, n in r["errors"]["counts"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="fraction of the duration before the after-warm-up sample (default 0.2)",
    )
    parser.add_argument("--rollouts", type=int, default=3, choices=(2, 3, 4), help="rollout threads (default 3)")
    parser.add_argument(
        "--sources",
        default=",".join(SOURCES),
        help="update sources to rotate, comma-separated (default: all; fewer to bisect a leak)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    sources = tuple(s for s in args.sources.split(",") if s)
    if args.duration < 30 or not 0 < args.warmup < 1:
        parser.error("--duration must be at least 30 s and --warmup a fraction in (0, 1)")
    if not sources or set(sources) - set(SOURCES):
        parser.error(f"--sources: a comma-separated subset of {','.join(SOURCES)}")
    soak = Soak(args.duration, args.duration * args.warmup, args.rollouts, sources)
    results = soak.run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    md = markdown(results)
    (args.out / "latest.md").write_text(md)
    print(md)
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    log(
        f"done in {results['elapsed_s']}s; wrote {args.out / 'latest.json'} and latest.md; "
        + ("PASSED" if not failed else "FAILED: " + ", ".join(failed))
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
