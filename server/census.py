"""The start-up census: every rank asked what runs on it, and where, before the server serves.

Runs in the `enginectl serve` process, on the control loop, once (server/wiring.py
`start_control_plane`, before anything else asks the ranks). Each EngineCore answers one
bounded utility call (contract/engine.py `Utility.CENSUS`, worker/engine_core.py), having
asked each of its workers (`WorkerRpc.CENSUS`): enginectl's version, whether enginectl's
scheduler runs, the host (hostname and boot id) and the workers' census (DESIGN §13).

An engine whose ranks disagree never serves: a rank without enginectl's worker extension
(every update would be a partial one), enginectl's scheduler on some ranks but not others, or
another enginectl version; `refusal()` names each rank, its host and why, and the server exits
non-zero with it. GetServerInfo lists every rank with its host and whether it runs on this
server's host (docs/multinode.md). A rank that can not answer at all (no enginectl utilities:
another scheduler on a multi-worker rank) is refused when other ranks answer, and left to the
checks that follow when none does (the engine then runs on vLLM's own utilities, as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from enginectl.common.host import HostIdentity, host_identity
from enginectl.contract.census import RankCensus
from enginectl.contract.engine import QUICK_RPC_TIMEOUT_S
from enginectl.server.worker_calls import RankOutcome
from enginectl.weights.v1 import weight_update_service_pb2 as pb2


class CensusEngine(Protocol):
    async def census(self, timeout: float) -> list[RankOutcome[RankCensus]]: ...


@dataclass(frozen=True)
class Census:
    """Every rank's census answer (or why it gave none), and this server's own identity."""

    outcomes: list[RankOutcome[RankCensus]]
    version: str  # this server's enginectl
    host: HostIdentity  # this server's

    def refusal(self) -> str | None:
        """Why this engine must not serve (None: every rank agrees), naming every rank."""
        answered = [o.result for o in self.outcomes if o.result is not None]
        if not answered:
            return None
        schedulers = {r.enginectl_scheduler for r in answered}
        problems = []
        for outcome in self.outcomes:
            rank = outcome.result
            if rank is None:
                problems.append(
                    f"rank {outcome.dp_rank}: no enginectl EngineCore utilities ({outcome.message}); start its "
                    "node with `enginectl serve --headless`, without a --scheduler-cls of its own"
                )
                continue
            where = f"rank {rank.dp_rank} (host {rank.hostname})"
            if rank.enginectl_version != self.version:
                problems.append(f"{where}: enginectl {rank.enginectl_version}, this server {self.version}")
            if rank.workers_error:
                problems.append(f"{where}: its workers lack enginectl's worker extension ({rank.workers_error})")
            if len(schedulers) > 1 and not rank.enginectl_scheduler:
                problems.append(f"{where}: runs {rank.scheduler}, not enginectl's scheduler as the other ranks do")
            for worker in rank.workers:
                if worker.enginectl_version != self.version:
                    problems.append(f"{where} worker {worker.worker_rank}: enginectl {worker.enginectl_version}")
        return "; ".join(problems) or None

    def enginectl_schedulers(self) -> bool:
        """Whether the ranks run enginectl's scheduler (they agree, or `refusal` says so)."""
        return any(o.result is not None and o.result.enginectl_scheduler for o in self.outcomes)

    def remote(self) -> dict[int, str]:
        """The ranks that run on another host than this server's: dp_rank -> their host name
        (empty for an engine on one host)."""
        return {
            o.result.dp_rank: o.result.hostname
            for o in self.outcomes
            if o.result is not None and HostIdentity(o.result.boot_id, o.result.hostname) != self.host
        }

    def ranks(self) -> list[pb2.RankInfo]:
        """GetServerInfo's ranks (those that answered)."""
        out = []
        for outcome in self.outcomes:
            rank = outcome.result
            if rank is None:
                continue
            out.append(
                pb2.RankInfo(
                    dp_rank=rank.dp_rank,
                    host=rank.hostname,
                    local=HostIdentity(rank.boot_id, rank.hostname) == self.host,
                    enginectl_version=rank.enginectl_version,
                    num_workers=len(rank.workers),
                    enginectl_scheduler=rank.enginectl_scheduler,
                    host_id=HostIdentity(rank.boot_id, rank.hostname).host_id,
                )
            )
        return out


async def take_census(engine: CensusEngine, version: str) -> Census:
    """Ask every rank (one bounded call each) and keep the answers."""
    outcomes = await engine.census(QUICK_RPC_TIMEOUT_S)
    return Census(outcomes, version, host_identity())
