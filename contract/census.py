"""The start-up census's answers: what runs on each rank, and where (DESIGN §13).

Torch-free and gRPC-free, as contract/engine.py beside it: written inside each EngineCore and
worker (worker/engine_core.py `enginectl_census`, worker/weights/extension.py), read by the
`enginectl serve` process (server/census.py). Its own module because its state is the engine's
start, not an update's or a call's; the calls that carry it are `Utility.CENSUS` and
`WorkerRpc.CENSUS` in contract/engine.py.
"""

from __future__ import annotations

import msgspec


class WorkerCensus(msgspec.Struct, frozen=True):
    """One worker in the start-up census: where it runs and which enginectl it has."""

    dp_rank: int
    worker_rank: int
    hostname: str
    boot_id: str
    enginectl_version: str


class RankCensus(msgspec.Struct, frozen=True):
    """One DP rank in the start-up census (server/census.py): its EngineCore's enginectl,
    scheduler and host, and every worker's census, or why the workers could not answer (a
    worker without enginectl's extension)."""

    dp_rank: int
    enginectl_version: str
    enginectl_scheduler: bool  # enginectl's scheduler runs (FPM samples, identity, pauses)
    scheduler: str  # the scheduler class, as "module.Class"
    hostname: str
    boot_id: str
    pid: int
    workers: list[WorkerCensus] = msgspec.field(default_factory=list)
    workers_error: str = ""
