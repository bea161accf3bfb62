"""Plain Python views of a fleet's state and of each step of a fleet update.

Runs wherever the client runs (client/fleet.py makes them); imports neither torch nor vLLM.
Every step names every server's outcome: a fleet update is never "it failed somewhere".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enginectl.client.errors import EnginectlError
from enginectl.client.trainer_types import GenerationState, StagedWeights, UpdateOperation, UpdateResult
from enginectl.client.types import UpdateFailure, WeightVersion


@dataclass(frozen=True)
class ServerOutcome:
    """What one step did on one server: `error` None means it succeeded."""

    target: str
    error: EnginectlError | None = None
    staged: StagedWeights | None = None  # a stage's set
    result: UpdateResult | None = None  # a commit's result
    # A failed commit: "quarantined" (it failed after writing began: paused, undeclared,
    # NOT_SERVING, see docs/operations.md) or "held" (it failed before writing: the fleet
    # keeps it paused on its old weights). repair() re-commits both.
    state: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def stage_outcome(target: str, answer: UpdateOperation | UpdateResult | EnginectlError) -> ServerOutcome:
    """A stage's outcome on `target` from its finished Operation or its result (or the
    call's error)."""
    if isinstance(answer, EnginectlError):
        return ServerOutcome(target, answer)
    if isinstance(answer, UpdateResult):
        return ServerOutcome(target, staged=answer.staged)
    if answer.error is not None:
        return ServerOutcome(target, answer.error)
    return ServerOutcome(target, staged=answer.response.staged if answer.response else None)


@dataclass(frozen=True)
class FleetStage:
    """Every server staged the same tensors: their staged sets, and the etag each server's
    version had when the stage began (the commit's fence)."""

    version: str | None
    outcomes: dict[str, ServerOutcome]
    etags: dict[str, str]

    @property
    def staged(self) -> dict[str, StagedWeights]:
        return {t: o.staged for t, o in self.outcomes.items() if o.staged is not None}

    @property
    def fingerprint(self) -> str | None:
        """The staged bytes' digest, when every server staged the same bytes (else None)."""
        digests = {s.fingerprint for s in self.staged.values()}
        return digests.pop() if len(digests) == 1 and len(self.staged) == len(self.outcomes) else None


@dataclass(frozen=True)
class FleetCommit:
    """A commit on every server: `mode` "strict" (one global pause) or "loose"."""

    version: str | None
    mode: str
    outcomes: dict[str, ServerOutcome]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes.values())

    @property
    def failed(self) -> dict[str, ServerOutcome]:
        return {t: o for t, o in self.outcomes.items() if not o.ok}


class FleetError(Exception):
    """A fleet step that did not succeed everywhere; `outcomes` says what happened where."""

    def __init__(self, message: str, outcomes: dict[str, ServerOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    def __str__(self) -> str:
        failed = "; ".join(f"{t}: {o.error}" for t, o in self.outcomes.items() if o.error is not None)
        return f"{self.args[0]} ({failed})" if failed else str(self.args[0])


class FleetStageError(FleetError):
    """A stage failed on some server: every staged set was discarded, no server changed."""


class FleetCommitError(FleetError):
    """A commit failed on some server (see `outcomes`, and Fleet.repair)."""


@dataclass(frozen=True)
class RankStatus:
    """One data-parallel rank of a server, as the Planner last heard from it."""

    dp_rank: int
    worker_id: str
    age_s: float  # since its newest forward-pass-metrics sample (heartbeats included)


@dataclass(frozen=True)
class ServerStatus:
    """One server of the fleet: its version, generation state, staged set, health."""

    target: str
    serving: bool  # gRPC health SERVING (False: starting, quarantined, or going away)
    version: WeightVersion | None = None
    generation: GenerationState | None = None
    ranks: tuple[RankStatus, ...] = ()
    error: EnginectlError | None = None  # the server could not be read

    @property
    def staged(self) -> StagedWeights | None:
        """The set it holds staged (with who staged it and when), if any."""
        return self.generation.staged if self.generation is not None else None

    @property
    def last_failure(self) -> UpdateFailure | None:
        """Why its last update failed after it began writing (None: it did not)."""
        return self.version.last_failure if self.version is not None else None

    @property
    def quarantined(self) -> bool:
        """Its last update failed after writing began: undeclared and NOT_SERVING until an update
        succeeds (docs/operations.md, "Quarantine")."""
        return self.last_failure is not None and self.version is not None and not self.version.declared


@dataclass(frozen=True)
class FleetStatus:
    """Every server's status; `consistent` when all serve one declared version."""

    servers: dict[str, ServerStatus] = field(default_factory=dict)

    @property
    def versions(self) -> set[str | None]:
        return {s.version.version if s.version is not None else None for s in self.servers.values()}

    @property
    def consistent(self) -> bool:
        """Every server reachable, SERVING, running, and declaring the same version."""
        return (
            all(
                s.serving and s.version is not None and s.version.declared and s.generation is not None
                for s in self.servers.values()
            )
            and len(self.versions) == 1
        )
