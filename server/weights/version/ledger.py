"""WeightVersionLedger: the one writer of the declared weight version.

Runs in the `enginectl serve` process, on its event loop. Pure Python: no gRPC server, no
vLLM; the engine is reached only through the `publish` callback given at construction.

Rules (docs/architecture.md, "Weight versions"):
- Nothing is declared at start: `declared=False`, no version, revision 0. Any non-empty
  UTF-8 string of at most 256 bytes without control characters is a version, "initial"
  and "default" included.
- Every write is serialised by one lock, in arrival order; a weight update holds the same
  lock while it loads, so a declaration that arrives meanwhile applies after it.
- A stale etag is refused (ABORTED, ETAG_MISMATCH); a retried request_id returns the first
  answer without declaring again.
- Watchers see the current state, then every change, in order, each once.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import UNDECLARED_LABEL
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field, out_of_range
from enginectl.server.limits import MAX_REQUEST_ID_BYTES, MAX_VERSION_BYTES, LabelProblem, label_problem


@dataclass(frozen=True)
class Fingerprint:
    """Digest of the weights in memory when a version was declared (VerifyWeights)."""

    method: str
    digest: str
    ranks: tuple[tuple[int, str], ...]  # (dp_rank, digest)
    # (dp_rank, worker_rank, digest): with tensor parallelism each worker's shard has its own,
    # so a rank that drifted can name the worker that did.
    workers: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True)
class Failure:
    """An update that failed after it began writing: the weights may be mixed."""

    reason: str
    cause: str
    message: str
    time: float
    attempted_version: str
    operation: str


@dataclass(frozen=True)
class VersionState:
    """One immutable state of the WeightVersion resource."""

    declared: bool
    version: str | None
    revision: int
    incarnation: str
    etag: str
    source: WeightSource
    declare_time: float | None
    fingerprint: Fingerprint | None
    last_failure: Failure | None
    # Internal: counts every change (declarations and, later, failures); drives etag & watch.
    change: int


class LedgerClosed(Exception):
    """The ledger was closed; watchers must end. `reason` (an ErrorInfo reason) says why:
    SHUTTING_DOWN, or ENGINE_DEAD when the engine died (the weights it described are gone)."""

    def __init__(self, reason: str = Reason.SHUTTING_DOWN, message: str = "server is shutting down") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# Publishes a declared version to the engine (vLLM's update_weight_version on every rank).
Publisher = Callable[[str], Awaitable[None]]
# Fingerprints the weights in memory now, on every rank.
Fingerprinter = Callable[[], Awaitable[Fingerprint]]


class WeightVersionLedger:
    """Holds the WeightVersion resource and serialises every write to it."""

    def __init__(
        self,
        *,
        publish: Publisher | None = None,
        fingerprint: Fingerprinter | None = None,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.time,
        history_limit: int = 1024,
        request_id_limit: int = 10_000,
        revisions_limit: int = 4096,
    ) -> None:
        self._publish = publish
        self._fingerprint = fingerprint
        self._clock = clock
        self._incarnation = incarnation or secrets.token_hex(8)
        self._state = VersionState(
            declared=False,
            version=None,
            revision=0,
            incarnation=self._incarnation,
            etag=self._etag(0),
            source=WeightSource.UNSPECIFIED,
            declare_time=None,
            fingerprint=None,
            last_failure=None,
            change=0,
        )
        self._history: deque[VersionState] = deque([self._state], maxlen=history_limit)
        self._write_lock = asyncio.Lock()
        # request_id -> ((version, etag), answer); oldest evicted first.
        self._answers: OrderedDict[str, tuple[tuple[str, str], VersionState]] = OrderedDict()
        self._request_id_limit = request_id_limit
        # version -> revision of its latest declaration (newest kept): what a generation that
        # ran under `version` reports as its revision (server/rollouts.py).
        self._revisions: OrderedDict[str, int] = OrderedDict()
        self._revisions_limit = revisions_limit
        self._changed = asyncio.Event()
        self._closed = False
        self._close_cause = (Reason.SHUTTING_DOWN, "server is shutting down")

    @property
    def state(self) -> VersionState:
        """The current state. Reading never waits for a writer."""
        return self._state

    def revision_of(self, version: str) -> int | None:
        """The revision of the latest declaration of `version`, if it is among the newest
        declarations kept."""
        return self._revisions.get(version)

    @property
    def incarnation(self) -> str:
        return self._incarnation

    async def declare(
        self,
        version: str,
        *,
        etag: str = "",
        request_id: str = "",
        source: WeightSource = WeightSource.DECLARED,
    ) -> VersionState:
        """Declare `version` for the weights in memory; returns the resulting state.

        Raises ControlPlaneError (state unchanged) for a missing or oversize version, a
        malformed or reused request_id, or a stale etag.
        """
        _validate_version(version)
        _validate_request_id(request_id)
        async with self._write_lock:
            if request_id:
                previous = self._answers.get(request_id)
                if previous is not None:
                    if previous[0] != (version, etag):
                        raise invalid_field(
                            Reason.REQUEST_ID_REUSED,
                            "request_id",
                            "already used by a different request",
                        )
                    return previous[1]
            self.check_etag(etag)
            if self._state.last_failure is not None:
                failure = self._state.last_failure
                raise ControlPlaneError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    Reason.PARTIAL_UPDATE,
                    f"the last update ({failure.operation}) failed part-way ({failure.cause}): the weights may be "
                    "mixed, so no version is declared over them; load weights again",
                    metadata={"cause": failure.cause, "operation": failure.operation},
                )
            fingerprint = await self._fingerprint() if self._fingerprint is not None else None
            if self._publish is not None:
                await self._publish(version)
            state = self._commit(
                declared=True,
                version=version,
                revision=self._state.revision + 1,
                source=source,
                declare_time=self._clock(),
                fingerprint=fingerprint,
            )
            if request_id:
                self._answers[request_id] = ((version, etag), state)
                while len(self._answers) > self._request_id_limit:
                    self._answers.popitem(last=False)
            return state

    def writing(self) -> asyncio.Lock:
        """The write lock: a weight update holds it from its first write to its record, so a
        declaration that arrives meanwhile applies after it (`async with ledger.writing():`)."""
        return self._write_lock

    def check_write(
        self, *, version: str | None, etag: str, request_id: str, version_field: str = "weight_version"
    ) -> None:
        """Validate an update's version fields before it starts (raises, changes nothing).
        `version_field` names the version in the BadRequest violation."""
        if version is not None:
            _validate_version(version, version_field)
        _validate_request_id(request_id)
        self.check_etag(etag)

    def check_etag(self, etag: str) -> None:
        """ABORTED ETAG_MISMATCH unless `etag` is empty or current. The error carries the
        current etag, revision and incarnation, so the writer can decide and retry without
        another read."""
        if etag and etag != self._state.etag:
            raise ControlPlaneError(
                grpc.StatusCode.ABORTED,
                Reason.ETAG_MISMATCH,
                "etag is not current (stale, or from another incarnation); re-read and retry",
                metadata={
                    "current_etag": self._state.etag,
                    "current_revision": str(self._state.revision),
                    "incarnation": self._incarnation,
                },
            )

    async def record_update(
        self,
        version: str | None,
        source: WeightSource,
        fingerprint: Fingerprint | None,
        *,
        published: bool = False,
    ) -> VersionState:
        """A successful update, with the write lock held: declare `version` (or become
        undeclared without one: new weights never keep an old label); clears last_failure.
        `published`: the caller already handed `version` to the engine."""
        assert self._write_lock.locked(), "record_update needs the write lock"
        if version is None:
            if self._publish is not None and not published:
                await self._publish(UNDECLARED_LABEL)
            return self._commit(
                declared=False,
                version=None,
                source=WeightSource.UNSPECIFIED,
                declare_time=None,
                fingerprint=None,
                last_failure=None,
            )
        if self._publish is not None and not published:
            await self._publish(version)
        return self._commit(
            declared=True,
            version=version,
            revision=self._state.revision + 1,
            source=source,
            declare_time=self._clock(),
            fingerprint=fingerprint,
            last_failure=None,
        )

    def record_failure(self, failure: Failure) -> VersionState:
        """An update failed after it began writing (write lock held): undeclared, with why."""
        assert self._write_lock.locked(), "record_failure needs the write lock"
        return self._commit(
            declared=False,
            version=None,
            source=WeightSource.UNSPECIFIED,
            declare_time=None,
            fingerprint=None,
            last_failure=failure,
        )

    def _commit(self, **changes: object) -> VersionState:
        change = self._state.change + 1
        self._state = replace(self._state, change=change, etag=self._etag(change), **changes)  # type: ignore[arg-type]
        if self._state.declared and self._state.version is not None:
            self._revisions[self._state.version] = self._state.revision
            self._revisions.move_to_end(self._state.version)
            if len(self._revisions) > self._revisions_limit:
                self._revisions.popitem(last=False)
        self._history.append(self._state)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._state

    def _etag(self, change: int) -> str:
        return hashlib.sha256(f"{self._incarnation}/{change}".encode()).hexdigest()[:20]

    async def watch(self, since_revision: int | None = None, incarnation: str = "") -> AsyncIterator[VersionState]:
        """Yield the current state (or every state after `since_revision`), then each change.

        `incarnation`: the one `since_revision` was read under; when given (with a
        `since_revision`) and not this ledger's, the watch fails with INCARNATION_CHANGED
        instead of resuming from an unrelated revision (revisions count afresh per start).
        Raises ControlPlaneError OUT_OF_RANGE for that, or when `since_revision` is older than
        the history kept or ahead of the current revision, and LedgerClosed when the ledger
        closes.
        """
        if since_revision is None:
            last_change = self._state.change - 1
        else:
            if incarnation and incarnation != self._incarnation:
                raise out_of_range(
                    Reason.INCARNATION_CHANGED,
                    f"incarnation {incarnation!r} is not this server's ({self._incarnation!r}): "
                    "it restarted and revisions count afresh; watch again without since_revision",
                    incarnation=self._incarnation,
                    current_revision=str(self._state.revision),
                )
            last_change = self._resume_point(since_revision)
        while True:
            changed = self._changed
            if self._closed:
                raise LedgerClosed(*self._close_cause)
            pending = [s for s in self._history if s.change > last_change]
            if pending and pending[0].change != last_change + 1:
                raise out_of_range(
                    Reason.REVISION_COMPACTED,
                    "this watcher fell behind the history kept; re-read the current state",
                    oldest_revision=str(self._history[0].revision),
                    incarnation=self._incarnation,
                )
            for state in pending:
                yield state
                last_change = state.change
            if not pending:
                await changed.wait()

    def _resume_point(self, since_revision: int) -> int:
        """The change counter after which a watch from `since_revision` starts."""
        if since_revision > self._state.revision:
            raise out_of_range(
                Reason.REVISION_IN_FUTURE,
                f"since_revision {since_revision} is ahead of the current revision "
                f"{self._state.revision} (an earlier incarnation?)",
                current_revision=str(self._state.revision),
                incarnation=self._incarnation,
            )
        oldest = self._history[0]
        if since_revision < oldest.revision:
            raise out_of_range(
                Reason.REVISION_COMPACTED,
                f"revision {since_revision} is older than the history kept",
                oldest_revision=str(oldest.revision),
                incarnation=self._incarnation,
            )
        # Replay every state recorded after the last one at `since_revision`.
        return max((s.change for s in self._history if s.revision <= since_revision), default=oldest.change)

    def close(self, reason: str = Reason.SHUTTING_DOWN, message: str = "server is shutting down") -> None:
        """End every watcher with LedgerClosed(reason, message); the first close's reason stays."""
        if not self._closed:
            self._close_cause = (reason, message)
        self._closed = True
        self._changed.set()


def _validate_version(version: str, field: str = "version") -> None:
    """The label rule of server/limits.py (as for worker ids): 1..256 bytes of UTF-8 without
    control characters, since a version goes into logs, metric labels and gRPC metadata."""
    problem = label_problem(version, MAX_VERSION_BYTES)
    if problem is None:
        return
    if problem is LabelProblem.EMPTY:
        raise invalid_field(Reason.VERSION_REQUIRED, field, "required, a non-empty string")
    if problem is LabelProblem.TOO_LONG:
        raise invalid_field(
            Reason.VERSION_TOO_LONG,
            field,
            f"{len(version.encode('utf-8'))} bytes of UTF-8; at most {MAX_VERSION_BYTES} allowed",
        )
    raise invalid_field(
        Reason.VERSION_INVALID, field, "must not contain control characters (U+0000-U+001F, U+007F-U+009F)"
    )


def _validate_request_id(request_id: str) -> None:
    if not request_id:
        return
    try:
        if len(request_id) > MAX_REQUEST_ID_BYTES:
            raise ValueError(request_id)
        uuid.UUID(request_id)
    except ValueError:
        raise invalid_field(Reason.REQUEST_ID_INVALID, "request_id", "must be a UUID, e.g. from uuid4()") from None
