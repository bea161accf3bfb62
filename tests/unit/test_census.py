"""The start-up census's verdict (server/census.py): which engines serve, and what
GetServerInfo lists. Plain RankCensus values, as the EngineCores answer them
(worker/engine_core.py `enginectl_census`); tests/e2e/test_headless.py takes a real census of a
head and a headless node, and refuses a real mixed engine.
"""

from __future__ import annotations

from enginectl.common.host import HostIdentity
from enginectl.contract.census import RankCensus, WorkerCensus
from enginectl.contract.engine import RankFailure
from enginectl.server.census import Census
from enginectl.server.worker_calls import RankOutcome

HERE = HostIdentity("boot-a", "node-a")
THERE = HostIdentity("boot-b", "node-b")
SCHEDULER = "enginectl.worker.fpm.scheduler.EnginectlScheduler"


def rank(dp_rank: int, host: HostIdentity = HERE, **changes: object) -> RankOutcome[RankCensus]:
    fields: dict[str, object] = {
        "dp_rank": dp_rank,
        "enginectl_version": "1.0",
        "enginectl_scheduler": True,
        "scheduler": SCHEDULER,
        "hostname": host.hostname,
        "boot_id": host.boot_id,
        "pid": 100 + dp_rank,
        "workers": [WorkerCensus(dp_rank, 0, host.hostname, host.boot_id, "1.0")],
    }
    fields.update(changes)
    return RankOutcome(dp_rank, RankCensus(**fields))  # type: ignore[arg-type]


def test_an_engine_whose_ranks_agree_serves_and_lists_where_each_runs() -> None:
    census = Census([rank(0), rank(1, THERE)], "1.0", HERE)
    assert census.refusal() is None
    assert [(r.dp_rank, r.host, r.local, r.num_workers) for r in census.ranks()] == [
        (0, "node-a", True, 1),
        (1, "node-b", False, 1),
    ]
    assert [r.host_id for r in census.ranks()] == [HERE.host_id, THERE.host_id] != [HERE.host_id] * 2


def test_a_mixed_engine_is_refused_naming_every_rank_its_host_and_why() -> None:
    census = Census(
        [
            rank(0),
            rank(1, THERE, enginectl_scheduler=False, scheduler="vllm.v1.core.sched.scheduler.Scheduler"),
            rank(2, THERE, workers=[], workers_error="RuntimeError: a worker failed in enginectl_census"),
            rank(3, THERE, enginectl_version="0.9"),
            RankOutcome(4, failure=RankFailure.RANK_ERROR, message="AttributeError: enginectl_census"),
        ],
        "1.0",
        HERE,
    )
    why = census.refusal()
    assert why is not None
    assert "rank 1 (host node-b): runs vllm.v1.core.sched.scheduler.Scheduler, not enginectl's scheduler" in why
    assert "rank 2 (host node-b): its workers lack enginectl's worker extension" in why
    assert "rank 3 (host node-b): enginectl 0.9, this server 1.0" in why
    assert "rank 4: no enginectl EngineCore utilities" in why
    assert "rank 0" not in why


def test_another_scheduler_on_every_rank_is_not_a_mixed_engine() -> None:
    """The user's own scheduler everywhere (single-worker ranks still answer through the
    worker extension): the engine runs on vLLM's pause utilities, as before the census."""
    other = {"enginectl_scheduler": False, "scheduler": "my.Scheduler"}
    assert Census([rank(0, **other), rank(1, **other)], "1.0", HERE).refusal() is None
    nobody = RankOutcome[RankCensus](0, failure=RankFailure.RANK_ERROR, message="no utility")
    assert Census([nobody], "1.0", HERE).refusal() is None
