"""Staging: the first phase of a two-phase update, and the staged set a commit applies.

Runs in the `enginectl serve` process, on the control loop. A `stage_only` update
(docs/weights.md, "Two-phase updates") is validated as any update (plans.py), then:
- no pause, no ledger lock, the version untouched: the update's source (plans.py
  UpdateSource) receives the bytes while generation goes on: the workers' staging threads
  into host memory (sources/workers.py, worker/weights/staging.py), or a transfer engine into
  each worker's staging target (sources/transfer_round.py);
- the server then reads every worker's StageResult and ends the Operation in phase STAGED
  with the set's name, size, digest and expiry, or fails it (nothing to undo: the model was
  never touched; the workers drop what they received).
At most one set exists; it expires after the TTL and is bounded by `--max-staged-bytes`.
CommitStagedWeights is an ordinary update of Source.STAGED (updates.py); this module only
checks the name, marks the set as the commit's while it runs and drops it when the commit
succeeded. While a commit applies the set, the commit wins: a discard is refused
(FAILED_PRECONDITION STAGED_COMMITTING, naming the commit) and frees nothing, and the TTL waits
for the commit to end; a failed commit keeps the set for another try (docs/weights.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from enginectl.contract.engine import STAGED_DIGEST_METHOD, Cause, StageResult
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.weights.convert import (
    duration,
    fingerprint_proto,
    load_results_proto,
    source_proto,
    weight_version_proto,
)
from enginectl.server.weights.engine_protocols import StagingEngine
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.update.outcome import UpdateFailed
from enginectl.server.weights.update.plans import UpdatePlan, UpdateSource
from enginectl.server.weights.version.ledger import Fingerprint, WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.staging")

STAGED_PREFIX = "staged/"
DEFAULT_TTL_S = 600.0
REMEMBER_EXPIRED = 16  # names of expired sets kept, so a late commit hears "expired"
EXPIRY_RETRY_S = 1.0  # a set whose TTL passed during its commit expires this long after


@dataclass
class StagedSet:
    """The staged set of this server (one at most), from its stage's start."""

    name: str
    token: str  # the workers' key for it
    operation: str
    plan: UpdatePlan
    ready: bool = False  # staging completed on every worker
    fingerprint: Fingerprint | None = None
    stage_time: float = 0.0  # time.time()
    expire_time: float = 0.0
    committing: str = ""  # the Operation of the commit applying this set, while it runs

    def proto(self) -> pb2.StagedWeights:
        msg = pb2.StagedWeights(
            name=self.name,
            operation=self.operation,
            source=source_proto(self.plan.source),
            tensors=len(self.plan.tensors),
            bytes=self.plan.bytes_total,
            staged_by=self.plan.by,
        )
        if self.plan.version is not None:
            msg.weight_version = self.plan.version
        if self.fingerprint is not None:
            msg.fingerprint.CopyFrom(fingerprint_proto(self.fingerprint))
        if self.ready:
            msg.stage_time.FromNanoseconds(int(self.stage_time * 1e9))
            msg.expire_time.FromNanoseconds(int(self.expire_time * 1e9))
        return msg


class Staging:
    """The staged set, its limits, and the stage runs (see the module docstring)."""

    def __init__(
        self,
        engine: StagingEngine,
        ledger: WeightVersionLedger,
        *,
        max_bytes: int,
        ttl: float = DEFAULT_TTL_S,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._on_bytes = on_bytes  # the staged-bytes gauge
        self.current: StagedSet | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._expired: OrderedDict[str, float] = OrderedDict()

    def info(self) -> pb2.StagingInfo:
        return pb2.StagingInfo(max_staged_bytes=self.max_bytes, ttl=duration(self.ttl))

    # --- stage ---------------------------------------------------------------------------

    def check_idle(self) -> None:
        """A stage still receiving holds the one update slot (the workers' RPC threads are free,
        but the set's memory and the trainer are busy): ABORTED UPDATE_IN_PROGRESS."""
        staged = self.current
        if staged is not None and not staged.ready:
            raise ControlPlaneError(
                grpc.StatusCode.ABORTED,
                Reason.UPDATE_IN_PROGRESS,
                f"{staged.operation} is staging; one update runs at a time",
                metadata={"operation": staged.operation},
            )

    def check(self, plan: UpdatePlan) -> None:
        """Refuse a stage that can not be kept, before anything is received."""
        if self.current is not None:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.STAGED_WEIGHTS_EXIST,
                f"{self.current.name} is staged (or being staged); commit or discard it first",
                metadata={"name": self.current.name},
            )
        if plan.bytes_total > self.max_bytes:
            raise ControlPlaneError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.STAGING_LIMIT_EXCEEDED,
                f"the update holds {plan.bytes_total} bytes; this server stages at most {self.max_bytes} "
                "(--max-staged-bytes)",
                metadata={"bytes": str(plan.bytes_total), "max_staged_bytes": str(self.max_bytes)},
            )

    def reserve(self, plan: UpdatePlan, op: UpdateOperation) -> StagedSet:
        """Hold the one place for the set `op` stages (check() passed)."""
        token = uuid.uuid4().hex
        self.current = StagedSet(f"{STAGED_PREFIX}{token}", token, op.name, plan)
        return self.current

    async def run(self, staged: StagedSet, op: UpdateOperation, source: UpdateSource, started: float) -> None:
        """The stage, start to end: the source receives the set (its workers' staging memory,
        or a transfer engine's staging target), then every worker's StageResult settles it;
        every way out finishes the Operation."""
        try:
            if op.cancel_requested.is_set():
                raise UpdateFailed(Cause.UPDATE_CANCELLED, "CancelOperation before staging began", modified=False)
            op.set_phase(pb2.UPDATE_PHASE_RECEIVING)
            plan = staged.plan
            received = await source.stage(op, plan, staged.token, time.time() + plan.timeout, self.max_bytes)
            staged.plan = received.plan
            await self._settle(staged, op, received.aborted, started)
        except Exception as exc:  # noqa: BLE001 - an operation must always end (see _failed)
            await self._failed(staged, op, exc)
        finally:
            source.close()

    async def _settle(
        self, staged: StagedSet, op: UpdateOperation, aborted: tuple[Cause, str] | None, started: float
    ) -> None:
        """Every worker's StageResult read: the set is ready and the Operation ends STAGED, or
        UpdateFailed is raised with the first worker's error."""
        plan = staged.plan
        results = [r for rank in await self._engine.stage_result(staged.token) for r in rank]
        errors = [(r.error.cause, r.error.message) for r in results if r.error is not None]
        if aborted and not errors:
            errors = [aborted]
        if not errors and not all(r.done for r in results):
            errors = [(Cause.LOAD_FAILED, "a worker reported the end of a staging it has not finished")]
        if not errors and self.current is not staged:
            errors = [(Cause.UPDATE_CANCELLED, "the staged set was discarded while it was received")]
        if errors:
            raise UpdateFailed(errors[0][0], errors[0][1], modified=False)
        self._ready(staged, results)
        op.set_phase(pb2.UPDATE_PHASE_STAGED)
        op.finish(response=self._response(staged, results, started))
        log.info(
            "weights staged",
            operation=op.name,
            name=staged.name,
            source=plan.source.value,
            tensors=len(plan.tensors),
            bytes=plan.bytes_total,
            seconds=round(time.monotonic() - started, 3),
        )

    def _ready(self, staged: StagedSet, results: list[StageResult]) -> None:
        staged.fingerprint = _fold(results)
        staged.ready = True
        staged.stage_time = time.time()
        staged.expire_time = staged.stage_time + self.ttl
        self._expiry = asyncio.get_running_loop().call_later(self.ttl, self._expire, staged)
        if self._on_bytes is not None:
            self._on_bytes(staged.plan.bytes_total)

    def _response(self, staged: StagedSet, results: list[StageResult], started: float) -> pb2.UpdateWeightsResponse:
        return pb2.UpdateWeightsResponse(
            weight_version=weight_version_proto(self._ledger.state),
            ranks=load_results_proto(results),
            generation_resumed=True,
            duration=duration(time.monotonic() - started),
            staged=staged.proto(),
        )

    async def _failed(self, staged: StagedSet, op: UpdateOperation, exc: BaseException) -> None:
        if isinstance(exc, UpdateFailed):
            failure = exc
        elif isinstance(exc, ControlPlaneError):
            failure = UpdateFailed(exc.reason, exc.message, modified=False)
        else:
            log.exception("stage failed unexpectedly", operation=op.name)
            failure = UpdateFailed(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}", modified=False)
        if self.current is staged:
            self.current = None
        try:
            await self._engine.discard_staged(staged.token, False)
        except ControlPlaneError:
            log.warning("dropping a failed stage on the workers failed", operation=op.name)
        error = failure.error(op.name)
        op.set_phase(pb2.UPDATE_PHASE_FAILED)
        op.fail(error)
        log.warning("stage failed", operation=op.name, cause=failure.cause, message=failure.message)

    # --- the set -------------------------------------------------------------------------

    def find(self, name: str) -> StagedSet:
        """The complete staged set `name`, for a commit; or why there is none."""
        if not name.startswith(STAGED_PREFIX) or len(name) > 256 or not name[len(STAGED_PREFIX) :].isalnum():
            raise invalid_field(Reason.STAGED_NAME_INVALID, "name", f"{name[:64]!r} is not a staged set name")
        staged = self.current
        if staged is None or staged.name != name:
            if name in self._expired:
                raise ControlPlaneError(
                    grpc.StatusCode.NOT_FOUND,
                    Reason.STAGED_WEIGHTS_EXPIRED,
                    f"{name} expired (kept {self.ttl:.0f}s) and was dropped; stage again",
                    metadata={"name": name},
                )
            raise _not_found(name)
        if not staged.ready:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.STAGE_INCOMPLETE,
                f"{name} is still being staged by {staged.operation}; wait for it to end",
                metadata={"name": name, "operation": staged.operation},
            )
        return staged

    def check_committable(self, token: str) -> None:
        """The set `token` a commit was planned for is still here (STAGED_WEIGHTS_NOT_FOUND)."""
        if self.current is None or self.current.token != token:
            raise _not_found(f"{STAGED_PREFIX}{token}")

    def commit_started(self, token: str, operation: str) -> None:
        """A commit of `token` starts (`operation`; check_committable passed): the set is the
        commit's until it ends."""
        assert self.current is not None and self.current.token == token
        self.current.committing = operation

    def commit_ended(self, token: str, operation: str) -> None:
        """The commit `operation` of `token` ended (a successful one consumed the set already)."""
        staged = self.current
        if staged is not None and staged.token == token and staged.committing == operation:
            staged.committing = ""

    async def committed(self, token: str) -> None:
        """A commit of `token` succeeded: the set is consumed (the workers keep the buffer for
        the next stage)."""
        staged = self.current
        if staged is None or staged.token != token:
            return
        self._clear()
        await self._engine.discard_staged(token, False)

    async def discard(self, name: str, allow_missing: bool, cancel: Callable[[str], None]) -> tuple[bool, int]:
        """DiscardStagedWeights: (found, bytes freed). A stage still receiving is cancelled
        through `cancel(operation name)`."""
        if not name.startswith(STAGED_PREFIX):
            raise invalid_field(Reason.STAGED_NAME_INVALID, "name", f"{name[:64]!r} is not a staged set name")
        staged = self.current
        if staged is None or staged.name != name:
            if allow_missing:
                return False, 0
            raise _not_found(name)
        if staged.committing:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.STAGED_COMMITTING,
                f"{name} is being applied by {staged.committing}; nothing was freed (a failed commit keeps the set)",
                metadata={"name": name, "operation": staged.committing},
            )
        if not staged.ready:
            cancel(staged.operation)
        self._clear()
        freed = await self._engine.discard_staged(staged.token, True)
        log.info("staged weights discarded", name=name, bytes=freed)
        return True, freed

    def _expire(self, staged: StagedSet) -> None:
        if self.current is not staged:
            return
        if staged.committing:  # the commit applying it wins; expire once it ended (and failed)
            self._expiry = asyncio.get_running_loop().call_later(EXPIRY_RETRY_S, self._expire, staged)
            return
        self._clear()
        self._expired[staged.name] = time.time()
        while len(self._expired) > REMEMBER_EXPIRED:
            self._expired.popitem(last=False)
        log.info("staged weights expired", name=staged.name, ttl=self.ttl)
        task = asyncio.ensure_future(self._engine.discard_staged(staged.token, True))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _clear(self) -> None:
        self.current = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._on_bytes is not None:
            self._on_bytes(0)


def _not_found(name: str) -> ControlPlaneError:
    return ControlPlaneError(
        grpc.StatusCode.NOT_FOUND,
        Reason.STAGED_WEIGHTS_NOT_FOUND,
        f"no staged set {name} (never staged, discarded, or committed already)",
        metadata={"name": name},
    )


def _fold(results: list[StageResult]) -> Fingerprint:
    """The workers' staged digests, per DP rank (a rank's workers staged the same bytes) and
    overall, as a Fingerprint."""
    per_rank: dict[int, list[StageResult]] = {}
    for r in results:
        per_rank.setdefault(r.dp_rank, []).append(r)
    ranks = []
    for rank in sorted(per_rank):
        digests = [w.digest for w in sorted(per_rank[rank], key=lambda w: w.worker_rank)]
        digest = (
            digests[0]
            if len(set(digests)) == 1
            else hashlib.blake2b("".join(digests).encode(), digest_size=16).hexdigest()
        )
        ranks.append((rank, digest))
    overall = hashlib.blake2b("|".join(d for _, d in ranks).encode(), digest_size=16).hexdigest()
    return Fingerprint(method=STAGED_DIGEST_METHOD, digest=overall, ranks=tuple(ranks))
