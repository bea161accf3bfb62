"""`enginectl fpm top`: a live table of every rank's latest forward-pass metrics sample, like `top`.

Runs in the `enginectl` process, on one asyncio loop: a `Planner` (client/planner.py) follows every
target's FPM stream (heartbeats included; a broken stream reconnects and resumes), and a
trainer client per target reads its data-parallel size once and its weight version at each
refresh, so every rank the server has gets a row, also before its first sample; a row's STATE
is the rank's generation state (RUNNING, PAUSED/<who holds it>, APPLYING). A frame is a
plain value (`TopFrame`): JSON with `-o json`, else `render_top` draws it, redrawn in place
with plain ANSI on a terminal (no curses), printed frame after frame otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from enginectl.cli.output import Output, cell, human_seconds, table
from enginectl.client.client import ChannelConfig
from enginectl.client.errors import EnginectlError
from enginectl.client.planner import Planner
from enginectl.client.rank_ranges import ExpectedRanks, engine_coverage
from enginectl.client.trainer import AsyncTrainerClient
from enginectl.client.trainer_types import ServerInfo
from enginectl.client.types import WeightVersion


@dataclass(frozen=True)
class TopEndpoint:
    """One target: its stream's state and the weight version it serves now."""

    target: str
    connected: bool
    incarnation: str
    data_parallel_size: int | None
    managed_ranks: tuple[int, ...] | None  # the DP ranks it manages (its node's, under hybrid LB)
    weight_version: str | None
    weight_revision: int | None
    samples: int
    missed: int
    reconnects: int
    error: str | None


@dataclass(frozen=True)
class TopRank:
    """The latest sample of one rank of one target (None fields: no sample yet)."""

    endpoint: str
    dp_rank: int
    worker_id: str | None = None
    kind: str | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    prefill_tokens: int | None = None  # prompt tokens the last step computed
    decode_requests: int | None = None  # requests the last step decoded (a token each)
    kv_cache_usage: float | None = None
    idle: bool | None = None
    age_s: float | None = None  # since the sample arrived here (the planner's clock)
    weight_revision: int | None = None
    sequence: int | None = None
    generation_state: str | None = None  # RUNNING, PAUSED or APPLYING (FpmGenerationState)
    pause_reason: str | None = None  # who holds the pause ("UNSPECIFIED" while running)


@dataclass(frozen=True)
class TopFrame:
    """One refresh: every target, then every rank, and the planner's verdict with --expect."""

    time: datetime
    interval_s: float
    endpoints: tuple[TopEndpoint, ...]
    ranks: tuple[TopRank, ...]
    verdict: str | None = None
    detail: str | None = None


@dataclass
class _Target:
    """What is read from one target besides its stream (by its trainer client)."""

    client: AsyncTrainerClient
    info: ServerInfo | None = None
    version: WeightVersion | None = None
    error: EnginectlError | None = field(default=None, repr=False)

    async def refresh(self, timeout: float) -> None:
        try:
            if self.info is None:
                self.info = await self.client.get_server_info(timeout=timeout)
            self.version = await self.client.get_weight_version(timeout=timeout)
            self.error = None
        except EnginectlError as err:
            self.error = err


def _covered(planner: Planner, targets: dict[str, _Target]) -> bool:
    """Every reachable target has a sample from each of its ranks (the first frame waits for it)."""
    seen = {(r.endpoint, r.dp_rank) for r in planner.fleet.latest()}
    for name, target in targets.items():
        if target.info is None:
            continue  # unreachable so far: nothing to wait for
        if not all((name, rank) in seen for rank in target.info.managed_ranks):
            return False
    return True


def build_frame(planner: Planner, targets: dict[str, _Target], interval: float, expect: Sequence[str]) -> TopFrame:
    """The frame for the planner's state now (call on the planner's loop)."""
    rows: dict[tuple[str, int], TopRank] = {}
    for name, target in targets.items():
        for rank in target.info.managed_ranks if target.info else ():
            rows[(name, rank)] = TopRank(name, rank)
    for r in planner.fleet.latest():
        s = r.sample
        rows[(r.endpoint, r.dp_rank)] = TopRank(
            r.endpoint,
            r.dp_rank,
            s.worker_id,
            s.kind.value,
            s.num_running,
            s.num_waiting,
            s.scheduled.sum_prefill_tokens,
            s.scheduled.num_decode_requests,
            s.kv_cache_usage,
            s.idle,
            r.age_s,
            s.weight_revision,
            s.sequence,
            generation_state=s.generation_state.value,
            pause_reason=s.pause_reason,
        )
    endpoints = []
    for name, target in targets.items():
        status, version = planner.status[name], target.version
        error = target.error or (None if status.connected else status.last_error)
        endpoints.append(
            TopEndpoint(
                name,
                status.connected,
                status.incarnation,
                target.info.data_parallel_size if target.info else None,
                tuple(target.info.managed_ranks) if target.info else None,
                (version.version if version.declared else "<undeclared>") if version else None,
                version.revision if version else None,
                status.samples,
                status.missed,
                status.reconnects,
                str(error) if error else None,
            )
        )
    verdict = detail = None
    if expect:
        judged = planner.reconcile(_expected(planner, targets, expect))
        verdict, detail = judged.verdict.value, judged.detail
    ordered = tuple(rows[key] for key in sorted(rows))
    return TopFrame(datetime.now(timezone.utc), interval, tuple(endpoints), ordered, verdict, detail)


def _expected(planner: Planner, targets: dict[str, _Target], expect: Sequence[str]) -> ExpectedRanks:
    """What `--expect` means: each worker id's ranks are those its targets manage (a target
    is its worker id's when its samples carry it); an id no target's samples carry yet is
    expected on every rank. The targets' managed ranks must tile each engine's ranks."""
    infos = {name: t.info for name, t in targets.items() if t.info is not None}
    carriers: dict[str, set[str]] = {}
    for r in planner.fleet.latest():
        carriers.setdefault(r.worker_id, set()).add(r.endpoint)
    size = max((i.data_parallel_size for i in infos.values()), default=1)
    by_worker = {
        w: tuple(sorted({rank for t in carriers.get(w, ()) if t in infos for rank in infos[t].managed_ranks}))
        or tuple(range(size))
        for w in expect
    }
    return ExpectedRanks(by_worker, tuple(engine_coverage(infos)))


def render_top(frame: TopFrame) -> str:
    """The frame as text: a title, the targets, the verdict, then a row per rank."""
    title = f"enginectl fpm top   {cell(frame.time)}   every {frame.interval_s:g}s"

    def state(e: TopEndpoint) -> str:
        return "connected" if e.connected else ("down" if e.error else "connecting")

    def version(e: TopEndpoint) -> str:
        return "-" if e.weight_version is None else f"{e.weight_version} (revision {e.weight_revision})"

    targets = table(
        ("ENDPOINT", "STATE", "WEIGHT VERSION", "DP", "SAMPLES", "MISSED", "RECONNECTS"),
        [(e.target, state(e), version(e), _dp(e), e.samples, e.missed, e.reconnects) for e in frame.endpoints],
    )

    def generation(r: TopRank) -> str | None:
        if r.generation_state == "PAUSED":
            return f"PAUSED/{r.pause_reason}"
        return r.generation_state

    errors = [f"{e.target}: {e.error}" for e in frame.endpoints if e.error]
    if frame.verdict:
        errors.append(f"verdict: {frame.verdict} ({frame.detail})")
    ranks = table(
        ("ENDPOINT", "WORKER", "RANK", "STATE", "RUNNING", "WAITING", "PREFILL", "DECODE", "KV", "IDLE", "AGE", "REV"),
        [
            (
                r.endpoint,
                r.worker_id,
                r.dp_rank,
                generation(r),
                r.num_running,
                r.num_waiting,
                r.prefill_tokens,
                r.decode_requests,
                None if r.kv_cache_usage is None else f"{100 * r.kv_cache_usage:.1f}%",
                r.idle,
                "never" if r.age_s is None else human_seconds(r.age_s),
                r.weight_revision,
            )
            for r in frame.ranks
        ],
    )
    return "\n".join([title, "", targets, *errors, "", ranks])


async def run_top(
    configs: Sequence[ChannelConfig],
    out: Output,
    *,
    interval: float,
    iterations: int,
    wait: float,
    stale_after: float,
    expect: Sequence[str],
) -> bool:
    """Draw frames every `interval` seconds (`iterations` of them; 0: until interrupted), the
    first once every rank of every reachable target has a sample or `wait` seconds passed.
    Returns whether every target was connected at the last frame."""
    targets = {
        c.target: _Target(
            AsyncTrainerClient(
                c.target,
                token=c.token,
                tls=c.tls,
                root_certificates=c.root_certificates,
                client_certificate=c.client_certificate,
                client_key=c.client_key,
            )
        )
        for c in configs
    }
    bound = max(1.0, interval)

    async def refresh() -> None:
        await asyncio.gather(*(t.refresh(bound) for t in targets.values()))

    try:
        async with Planner(configs, stale_after=stale_after) as planner:
            await refresh()
            await planner.wait_for(lambda p: _covered(p, targets), wait)
            drawn = 0
            while True:
                frame = build_frame(planner, targets, interval, expect)
                out.frame(frame, render_top)
                drawn += 1
                if iterations and drawn >= iterations:
                    return all(e.connected for e in frame.endpoints)
                await asyncio.sleep(interval)  # the refresh period, as top's -d
                await refresh()
    finally:
        await asyncio.gather(*(t.client.close() for t in targets.values()), return_exceptions=True)


def _dp(e: TopEndpoint) -> str | int | None:
    """The DP size, with the ranks the target manages when they are not all of them."""
    if e.managed_ranks is None or e.data_parallel_size is None or len(e.managed_ranks) == e.data_parallel_size:
        return e.data_parallel_size
    return f"{e.managed_ranks[0]}-{e.managed_ranks[-1]} of {e.data_parallel_size}"
