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
    config_digest: str = ""  # of the EngineConfig the rank holds ("" under another scheduler)


class RankConfigured(msgspec.Struct, frozen=True):
    """A rank's answer to CONFIGURE: the digest of the EngineConfig it now holds (equal to
    the sent one's) and the relay endpoint its publisher uses ("" for none)."""

    dp_rank: int
    digest: str
    fpm_endpoint: str
