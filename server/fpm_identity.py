"""IdentitySync: sets and reads the worker identity on every data-parallel rank.

Runs in the `enginectl serve` process, on the control loop. The rules of FpmIdentityService
(protos/enginectl/fpm/v1/fpm_identity_service.proto) live here, the servicer only
translates protos: input bounds, one change at a time, the new generation (one above the
highest any rank holds, the same on every rank), the safe retry, and per-rank outcomes,
each rank called on its own (EngineAdapter.call_each) so a rank that fails or hangs is named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from enginectl.fpm.v1 import fpm_identity_service_pb2 as pb2
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import (
    DEFAULT_GET_IDENTITY_TIMEOUT_S as DEFAULT_GET_TIMEOUT_S,
    DEFAULT_SET_IDENTITY_TIMEOUT_S as DEFAULT_SET_TIMEOUT_S,
    MAX_IDENTITY_TIMEOUT_S as MAX_TIMEOUT_S,
    MAX_WORKER_ID_BYTES,
    LabelProblem,
    label_problem,
)
from enginectl.worker.fpm_identity import GET_IDENTITY_UTILITY, SET_IDENTITY_UTILITY

if TYPE_CHECKING:
    from enginectl.server.engine import RankOutcome


class RankCaller(Protocol):
    """What IdentitySync needs of the engine (EngineAdapter)."""

    async def call_each(self, method: str, *args: Any, timeout: float) -> list[RankOutcome]: ...


@dataclass(frozen=True)
class RankIdentity:
    """The identity one rank holds (generation 0: none was ever set)."""

    dp_rank: int
    worker_id: str
    generation: int

    def proto(self) -> pb2.RankIdentity:
        return pb2.RankIdentity(
            dp_rank=self.dp_rank, worker_id=self.worker_id, identity_generation=self.generation
        )


@dataclass(frozen=True)
class IdentityReport:
    """GetWorkerIdentity's answer."""

    ranks: tuple[RankIdentity, ...]
    await_worker_id: bool

    @property
    def consistent(self) -> bool:
        """Every rank holds the same non-empty worker id at the same generation."""
        return bool(self.ranks) and all(
            r.worker_id and (r.worker_id, r.generation) == (self.ranks[0].worker_id, self.ranks[0].generation)
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
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise invalid_field(Reason.TIMEOUT_INVALID, "timeout", f"must be more than 0 and at most {MAX_TIMEOUT_S:.0f}s")
    return seconds


def _rank_identity(outcome: RankOutcome) -> RankIdentity:
    answer = outcome.result
    return RankIdentity(int(answer["dp_rank"]), str(answer["worker_id"]), int(answer["identity_generation"]))


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


class IdentitySync:
    """One per server. `on_outcome(ok)` hears about every SetWorkerIdentity that reached the
    ranks (True: all acked), e.g. to gate health in `--await-worker-id` mode."""

    def __init__(self, engine: RankCaller, *, await_worker_id: bool = False,
                 on_outcome: Callable[[bool], None] | None = None) -> None:
        self._engine = engine
        self.await_worker_id = await_worker_id
        self._on_outcome = on_outcome
        self._lock = asyncio.Lock()  # identity changes are applied one at a time

    async def get(self, timeout: float) -> IdentityReport:
        """Ask every rank for the identity it holds now."""
        outcomes = await self._engine.call_each(GET_IDENTITY_UTILITY, timeout=timeout)
        failed = [o for o in outcomes if o.failure]
        if failed:
            timed_out = any(o.failure == "RANK_TIMEOUT" for o in failed)
            raise ControlPlaneError(
                grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE,
                Reason.IDENTITY_READ_FAILED,
                "ranks did not report their identity: "
                + "; ".join(f"rank {o.dp_rank}: {o.failure} {o.message}" for o in failed),
                metadata={"failed_ranks": _ranks([o.dp_rank for o in failed])},
            )
        return IdentityReport(tuple(_rank_identity(o) for o in outcomes), self.await_worker_id)

    async def set(self, worker_id: str, timeout: float) -> list[RankIdentity]:
        """Make every rank hold `worker_id` at one new generation; returns the acks, in rank
        order. Raises IDENTITY_SYNC_FAILED (with an IdentitySyncFailure detail) when a rank
        does not ack within `timeout`."""
        check_worker_id(worker_id)
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            held = await self._engine.call_each(GET_IDENTITY_UTILITY, timeout=timeout)
            failed = [o for o in held if o.failure]
            known = [_rank_identity(o) for o in held if not o.failure]
            generation = max((r.generation for r in known), default=0) + 1
            if not failed and all(
                (r.worker_id, r.generation) == (worker_id, known[0].generation) for r in known
            ):
                self._report(True)  # every rank already holds it: a safe retry
                return known
            if not failed:
                acks = await self._engine.call_each(
                    SET_IDENTITY_UTILITY, worker_id, generation, timeout=max(0.0, deadline - loop.time())
                )
                failed = [o for o in acks if o.failure]
                known = [_rank_identity(o) for o in acks if not o.failure]
            else:
                known = []  # nothing was set: no rank acked this change
            self._report(not failed)
            if failed:
                raise _sync_failed(worker_id, generation, known, failed)
            return known

    def _report(self, ok: bool) -> None:
        if self._on_outcome is not None:
            self._on_outcome(ok)


def _sync_failed(worker_id: str, generation: int, acked: list[RankIdentity],
                 failed: list[RankOutcome]) -> ControlPlaneError:
    timed_out = any(o.failure == "RANK_TIMEOUT" for o in failed)
    detail = pb2.IdentitySyncFailure(
        worker_id=worker_id,
        identity_generation=generation,
        acked=[r.proto() for r in acked],
        failed=[pb2.RankIdentityError(dp_rank=o.dp_rank, reason=o.failure, message=o.message[:1000])
                for o in failed],
    )
    return ControlPlaneError(
        grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.UNAVAILABLE,
        Reason.IDENTITY_SYNC_FAILED,
        f"worker identity {worker_id!r} (generation {generation}) was not applied on ranks "
        f"{_ranks([o.dp_rank for o in failed])}: "
        + "; ".join(f"rank {o.dp_rank}: {o.failure} {o.message[:200]}" for o in failed),
        metadata={
            "failed_ranks": _ranks([o.dp_rank for o in failed]),
            "acked_ranks": _ranks([r.dp_rank for r in acked]),
            "worker_id": worker_id,
            "identity_generation": str(generation),
        },
        details=[detail],
    )
