"""IdentitySync: sets and reads the worker identity on every data-parallel rank.

Runs in the `enginectl serve` process, on the control loop. The rules of FpmIdentityService
(protos/enginectl/fpm/v1/fpm_identity_service.proto) live here, the servicer only
translates protos: input bounds, one change at a time, the new generation (one above the
highest any rank holds, the same on every rank), the safe retry, and per-rank outcomes,
each rank called on its own (EngineAdapter.get_worker_identity / set_worker_identity) so a
rank that fails or hangs is named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from enginectl.contract.engine import RankFailure, RankIdentity
from enginectl.fpm.v1 import fpm_identity_service_pb2 as pb2
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import MAX_IDENTITY_TIMEOUT_S, MAX_WORKER_ID_BYTES, LabelProblem, label_problem

if TYPE_CHECKING:
    from enginectl.server.worker_calls import RankOutcome


class IdentityEngine(Protocol):
    """What IdentitySync needs of the engine (EngineAdapter): per-rank outcomes, each rank
    bounded by `timeout` on its own."""

    async def get_worker_identity(self, timeout: float) -> list[RankOutcome[RankIdentity]]: ...

    async def set_worker_identity(
        self, worker_id: str, generation: int, timeout: float
    ) -> list[RankOutcome[RankIdentity]]: ...


def rank_proto(rank: RankIdentity) -> pb2.RankIdentity:
    """The proto of one rank's identity (generation 0: none was ever set)."""
    return pb2.RankIdentity(
        dp_rank=rank.dp_rank, worker_id=rank.worker_id, identity_generation=rank.identity_generation
    )


@dataclass(frozen=True)
class IdentityReport:
    """GetWorkerIdentity's answer."""

    ranks: tuple[RankIdentity, ...]
    await_worker_id: bool

    @property
    def consistent(self) -> bool:
        """Every rank holds the same non-empty worker id at the same generation."""
        first = self.ranks[0] if self.ranks else None
        return first is not None and all(
            r.worker_id and (r.worker_id, r.identity_generation) == (first.worker_id, first.identity_generation)
            for r in self.ranks
        )


def check_worker_id(worker_id: str) -> None:
    """INVALID_ARGUMENT unless `worker_id` is 1 to 256 bytes of UTF-8 without control
    characters (it ends up in logs, metric labels and planner keys): the label rule of
    server/limits.py, shared with versions."""
    problem = label_problem(worker_id, MAX_WORKER_ID_BYTES)
    if problem is LabelProblem.EMPTY:
        raise invalid_field(Reason.WORKER_ID_REQUIRED, "worker_id", "required, a non-empty string")
    if problem is LabelProblem.TOO_LONG:
        raise invalid_field(Reason.WORKER_ID_TOO_LONG, "worker_id", f"at most {MAX_WORKER_ID_BYTES} bytes of UTF-8")
    if problem is LabelProblem.CONTROL_CHARACTER:
        raise invalid_field(Reason.WORKER_ID_INVALID, "worker_id", "must not contain control characters")


def check_timeout(seconds: float | None, default: float) -> float:
    """The timeout to use: `default` when unset; INVALID_ARGUMENT unless 0 < seconds <= 300."""
    if seconds is None:
        return default
    if not 0 < seconds <= MAX_IDENTITY_TIMEOUT_S:
        raise invalid_field(
            Reason.TIMEOUT_INVALID, "timeout", f"must be more than 0 and at most {MAX_IDENTITY_TIMEOUT_S:.0f}s"
        )
    return seconds


def _acked(outcomes: list[RankOutcome[RankIdentity]]) -> list[RankIdentity]:
    """The identities of the ranks that answered, in rank order."""
    return [o.result for o in outcomes if o.failure is None and o.result is not None]


def _failed(outcomes: list[RankOutcome[RankIdentity]]) -> list[RankOutcome[RankIdentity]]:
    return [o for o in outcomes if o.failure is not None]


def _failure(outcome: RankOutcome[RankIdentity]) -> str:
    """The outcome's failure reason as it goes on the wire (RANK_TIMEOUT, ...)."""
    return outcome.failure.value if outcome.failure is not None else ""


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


class IdentitySync:
    """One per server. `on_outcome(ok)` hears about every SetWorkerIdentity that reached the
    ranks (True: all acked), e.g. to gate health in `--await-worker-id` mode; `on_synced`
    hears the same calls' result ("ok", "unchanged": a safe retry, or "failed"), e.g. to
    count them."""

    def __init__(
        self,
        engine: IdentityEngine,
        *,
        await_worker_id: bool = False,
        on_outcome: Callable[[bool], None] | None = None,
        on_synced: Callable[[str], None] | None = None,
    ) -> None:
        self._engine = engine
        self.await_worker_id = await_worker_id
        self._on_outcome = on_outcome
        self._on_synced = on_synced
        self._lock = asyncio.Lock()  # identity changes are applied one at a time

    async def get(self, timeout: float) -> IdentityReport:
        """Ask every rank for the identity it holds now."""
        outcomes = await self._engine.get_worker_identity(timeout)
        failed = _failed(outcomes)
        if failed:
            timed_out = any(o.failure is RankFailure.RANK_TIMEOUT for o in failed)
            raise ControlPlaneError(
                grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE,
                Reason.IDENTITY_READ_FAILED,
                "ranks did not report their identity: "
                + "; ".join(f"rank {o.dp_rank}: {_failure(o)} {o.message}" for o in failed),
                metadata={"failed_ranks": _ranks([o.dp_rank for o in failed])},
            )
        return IdentityReport(tuple(_acked(outcomes)), self.await_worker_id)

    async def set(self, worker_id: str, timeout: float) -> list[RankIdentity]:
        """Make every rank hold `worker_id` at one new generation; returns the acks, in rank
        order. Raises IDENTITY_SYNC_FAILED (with an IdentitySyncFailure detail) when a rank
        does not ack within `timeout`."""
        check_worker_id(worker_id)
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            held = await self._engine.get_worker_identity(timeout)
            failed = _failed(held)
            known = _acked(held)
            generation = max((r.identity_generation for r in known), default=0) + 1
            if not failed and all(
                (r.worker_id, r.identity_generation) == (worker_id, known[0].identity_generation) for r in known
            ):
                self._report(True, "unchanged")  # every rank already holds it: a safe retry
                return known
            if not failed:
                acks = await self._engine.set_worker_identity(
                    worker_id, generation, timeout=max(0.0, deadline - loop.time())
                )
                failed = _failed(acks)
                known = _acked(acks)
            else:
                known = []  # nothing was set: no rank acked this change
            self._report(not failed, "failed" if failed else "ok")
            if failed:
                raise _sync_failed(worker_id, generation, known, failed)
            return known

    def _report(self, ok: bool, result: str) -> None:
        if self._on_outcome is not None:
            self._on_outcome(ok)
        if self._on_synced is not None:
            self._on_synced(result)


def _sync_failed(
    worker_id: str, generation: int, acked: list[RankIdentity], failed: list[RankOutcome[RankIdentity]]
) -> ControlPlaneError:
    timed_out = any(o.failure is RankFailure.RANK_TIMEOUT for o in failed)
    detail = pb2.IdentitySyncFailure(
        worker_id=worker_id,
        identity_generation=generation,
        acked=[rank_proto(r) for r in acked],
        failed=[pb2.RankIdentityError(dp_rank=o.dp_rank, reason=_failure(o), message=o.message[:1000]) for o in failed],
    )
    return ControlPlaneError(
        grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE,
        Reason.IDENTITY_SYNC_FAILED,
        f"worker identity {worker_id!r} (generation {generation}) was not applied on ranks "
        f"{_ranks([o.dp_rank for o in failed])}: "
        + "; ".join(f"rank {o.dp_rank}: {_failure(o)} {o.message[:200]}" for o in failed),
        metadata={
            "failed_ranks": _ranks([o.dp_rank for o in failed]),
            "acked_ranks": _ranks([r.dp_rank for r in acked]),
            "worker_id": worker_id,
            "identity_generation": str(generation),
        },
        details=[detail],
    )
