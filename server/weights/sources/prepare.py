"""Prepare before write: every worker of every rank can read what a disk update planned.

Runs in the `enginectl serve` process, on the control loop, from WeightUpdates.start: after
the update is known to be the only one and before its Operation exists, anything is paused or
any weight is written (DESIGN §13, "Prepare before write"). The server planned the update from
the safetensors headers it read on its own host (disk.py `read_planned`); a rank on another
node may see no such file, another file under that name, or a copy cut short, and would then
fail its load after the other ranks wrote theirs: a partial update, the engine quarantined.
Instead every worker opens every planned file and compares its header with the planned one
(WorkerRpc.PREPARE, worker/weights/prepare.py), and a worker that can not makes the update a
clean refusal: FAILED_PRECONDITION CHECKPOINT_NOT_ON_RANK, naming the rank, its host and why,
with nothing touched on any rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import grpc
import structlog

from enginectl.contract.prepare import Prepared, PreparePlan
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.weights.update.plans import UpdatePlan

log = structlog.get_logger("enginectl.updates")

MAX_NAMED = 8  # workers named in a refusal's message (the first one's details in its metadata)


class PrepareEngine(Protocol):
    async def prepare(self, plan: PreparePlan) -> list[Prepared]: ...


def prepare_plan(plan: UpdatePlan) -> PreparePlan | None:
    """What every worker checks before `plan` writes (None: nothing: it reads no file)."""
    return PreparePlan(plan.headers) if plan.headers else None


async def prepare(engine: PrepareEngine, plan: UpdatePlan, remote_ranks: Mapping[int, str]) -> None:
    """Every worker checks it can read what `plan` reads, as planned; raises the refusal
    (`refusal`) if one can not. A worker that does not answer in time raises the worker
    call's DEADLINE_EXCEEDED WORKER_TIMEOUT: refused as well, nothing touched."""
    asked = prepare_plan(plan)
    if asked is None:
        return
    started = time.monotonic()
    answers = await engine.prepare(asked)
    refused = refusal(answers, remote_ranks)
    log.info(
        "update prepared" if refused is None else "update refused by its prepare",
        source=plan.source.value,
        request_id=plan.request_id,
        files=len(asked.files),
        workers=len(answers),
        seconds=round(time.monotonic() - started, 4),
        slowest_worker_s=round(max((a.seconds for a in answers), default=0.0), 4),
    )
    if refused is not None:
        raise refused


def refusal(answers: list[Prepared], remote_ranks: Mapping[int, str]) -> ControlPlaneError | None:
    """FAILED_PRECONDITION CHECKPOINT_NOT_ON_RANK naming every worker that can not read the
    plan (its rank, host and why; the first one's in the metadata), or None when all can.
    A rank's host is the census's name for it when it runs elsewhere (`remote_ranks`), else
    the name its worker reported."""
    failed = [a for a in answers if a.problem is not None]
    if not failed:
        return None
    first = failed[0]
    assert first.problem is not None

    def host(answer: Prepared) -> str:
        return remote_ranks.get(answer.dp_rank) or answer.hostname

    named = [f"rank {a.dp_rank} worker {a.worker_rank} (host {host(a)}): {a.message}" for a in failed[:MAX_NAMED]]
    more = f"; and {len(failed) - MAX_NAMED} more" if len(failed) > MAX_NAMED else ""
    return ControlPlaneError(
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.CHECKPOINT_NOT_ON_RANK,
        "the checkpoint can not be read as planned on every rank, so nothing was loaded (the weights, the "
        f"version and generation are as they were): {'; '.join(named)}{more}. Put the same files at the same "
        "path on every node, or send the weights over UpdateWeightsFromTensors or a broadcast group",
        metadata={
            "dp_rank": str(first.dp_rank),
            "worker_rank": str(first.worker_rank),
            "host": host(first),
            "path": first.path,
            "problem": first.problem.value,
            "ranks": ",".join(str(r) for r in sorted({a.dp_rank for a in failed})),
        },
    )
