"""Rank ranges: which data-parallel ranks each server of a fleet manages, and which ranks of a
broadcast group its workers take (docs/multinode.md, "One server per node").

Pure arithmetic on GetServerInfo answers; no I/O. A server manages every rank of its engine,
or under vLLM's hybrid load balancing (`--data-parallel-hybrid-lb`) only its node's
(`ServerInfo.managed_ranks`); servers of one engine share `ServerInfo.engine_id`.

- `group_windows`: the group ranks of each server's workers, server after server from rank 1
  (the trainer is rank 0): the windows tile 1..world_size-1, none overlaps another.
- `engine_coverage`: per engine, whether its servers' managed ranks tile 0..dp_size-1, with
  the gaps and the overlaps named.
- `expected_ranks`: what a planner should see per worker id (client/planner.py `reconcile`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from enginectl.client.trainer_types import ServerInfo


def group_windows(workers: Mapping[str, int], first: int = 1) -> tuple[dict[str, range], int]:
    """Each server's window of group ranks (target -> range), in `workers` order from `first`,
    and the group's world size: `workers` is target -> its managed workers
    (`ServerInfo.num_workers`)."""
    windows, at = {}, first
    for target, count in workers.items():
        if count < 0:
            raise ValueError(f"{target}: {count} workers")
        windows[target] = range(at, at + count)
        at += count
    return windows, at


@dataclass(frozen=True)
class EngineCoverage:
    """How the servers of one engine cover its ranks 0..dp_size-1."""

    engine_id: str
    dp_size: int
    servers: dict[str, range]  # target -> its managed ranks
    gaps: tuple[int, ...] = ()  # ranks no server manages
    overlaps: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> the servers claiming it
    sizes: dict[str, int] = field(default_factory=dict)  # target -> its dp size, when they disagree

    @property
    def ok(self) -> bool:
        return not (self.gaps or self.overlaps or self.sizes)

    def describe(self) -> str:
        """The problems, named ("" when `ok`)."""
        parts = []
        if self.sizes:
            parts.append(f"servers disagree on the engine's DP size: {self.sizes}")
        if self.gaps:
            parts.append(f"ranks {list(self.gaps)} of {self.dp_size} are managed by no server")
        for rank, targets in sorted(self.overlaps.items()):
            parts.append(f"rank {rank} is managed by {len(targets)} servers ({', '.join(targets)})")
        return f"engine {self.engine_id}: " + "; ".join(parts) if parts else ""


def engine_coverage(infos: Mapping[str, ServerInfo]) -> list[EngineCoverage]:
    """Group the servers (target -> GetServerInfo) by engine and judge each engine's cover."""
    engines: dict[str, dict[str, ServerInfo]] = defaultdict(dict)
    for target, info in infos.items():
        engines[info.engine_id or target][target] = info
    out = []
    for engine_id, members in engines.items():
        sizes = {t: i.data_parallel_size for t, i in members.items()}
        dp_size = max(sizes.values())
        claims: dict[int, list[str]] = defaultdict(list)
        for target, info in members.items():
            for rank in info.managed_ranks:
                claims[rank].append(target)
        out.append(
            EngineCoverage(
                engine_id,
                dp_size,
                {t: i.managed_ranks for t, i in members.items()},
                gaps=tuple(r for r in range(dp_size) if r not in claims),
                overlaps={r: tuple(ts) for r, ts in sorted(claims.items()) if len(ts) > 1},
                sizes=sizes if len(set(sizes.values())) > 1 else {},
            )
        )
    return out


@dataclass(frozen=True)
class ExpectedRanks:
    """What a planner should see: per worker id, the DP ranks that publish under it (the
    union of its servers' managed ranks); `problems` names each engine whose servers do not
    tile its ranks (then no verdict can be OK)."""

    by_worker: dict[str, tuple[int, ...]]
    engines: tuple[EngineCoverage, ...] = ()

    @property
    def problems(self) -> str:
        return "; ".join(e.describe() for e in self.engines if not e.ok)


def expected_ranks(servers: Mapping[str, tuple[str, ServerInfo]]) -> ExpectedRanks:
    """From target -> (the worker id its FPM samples carry, its GetServerInfo): the ranks each
    worker id should publish, and how each engine's servers cover its ranks."""
    by_worker: dict[str, set[int]] = defaultdict(set)
    for worker_id, info in servers.values():
        by_worker[worker_id].update(info.managed_ranks)
    coverage = engine_coverage({t: info for t, (_, info) in servers.items()})
    return ExpectedRanks({w: tuple(sorted(rs)) for w, rs in sorted(by_worker.items())}, tuple(coverage))
