"""UpdatePlan: what an update loads, and the source its weights arrive by.

Runs in the `enginectl serve` process, on the control loop. A request that passed every check
(sources/validation.py) becomes a plan; the plan names its source when the bytes do not come
from the workers' own reading (a tensor stream, a transfer round: `via`), and
WeightUpdates.start chooses the source once from it. `UpdateSource` is what every step of an
update asks of that source: load into the model (for an UpdateRun, update/run.py), stage (for
Staging, update/staging.py), abort, and release. The implementations are in sources/
(docs/architecture.md, "Update sources"):

- the workers read the weights themselves (sources/workers.py `WorkersRead`): a checkpoint on
  disk, the trainer's shared memory (IPC), its broadcast group, a staged set (a commit), and a
  tensor stream, whose chunks the server feeds through the update's channels;
- a transfer round (sources/transfer_round.py `TransferRound`): vLLM's weight-transfer engine
  moves the bytes, one step per trainer call.

A source answers what the run needs to finish (`Loaded`, `Staged`) instead of changing the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from enginectl.common import dtypes
from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import Cause, IpcHandle, LoadResult, TensorSpec
from enginectl.contract.prepare import PlannedFile
from enginectl.server.weights.update.operations import UpdateOperation


@dataclass(frozen=True)
class TensorInfo:
    """One tensor an update names: as the checkpoint's safetensors header or the request says."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)


@dataclass
class UpdatePlan:
    """A validated update, before anything was touched."""

    source: WeightSource
    tensors: list[TensorInfo]
    files: list[Path]
    group: str
    version: str | None
    etag: str
    request_id: str
    pause_mode: str
    reset_cache: bool
    timeout: float
    bucket_bytes: int = 0  # DISTRIBUTED: one broadcast per bucket (common/buckets.py); 0 per tensor
    handles: tuple[IpcHandle, ...] = ()  # IPC: one per tensor (ipc.py)
    stage_only: bool = False  # receive into the staging area; CommitStagedWeights applies it
    stage_token: str = ""  # a commit: load the set the workers staged under this token
    # DISK: each file's header as the server read it, which every worker compares its own with
    # before anything is written (sources/prepare.py); one per file, in `files` order.
    headers: tuple[PlannedFile, ...] = field(default=(), compare=False, repr=False)
    # The source the bytes arrive by when the workers do not read them themselves (a tensor
    # stream, a transfer round); None: they do (WeightUpdates.start chooses).
    via: UpdateSource | None = field(default=None, compare=False, repr=False)
    # Who asked for it (servicer_context.caller_of): logged, and named by the set a stage keeps.
    by: str = field(default="", compare=False)

    def asked_by(self, caller: str) -> UpdatePlan:
        """This plan, asked for by `caller`."""
        return replace(self, by=caller)

    def arriving_by(self, source: UpdateSource) -> UpdatePlan:
        """This plan, its bytes arriving by `source`."""
        return replace(self, via=source)

    @property
    def bytes_total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.dtype, t.shape) for t in self.tensors)

    def key(self) -> tuple[Any, ...]:
        """What makes two requests with one request_id the same request."""
        return (
            self.source,
            tuple(self.tensors),
            tuple(self.files),
            self.group,
            self.version,
            self.etag,
            self.pause_mode,
            self.reset_cache,
            self.bucket_bytes,
            self.handles,
            self.stage_only,
            self.stage_token,
        )


@dataclass(frozen=True)
class Loaded:
    """What a source's load ended with: every worker's own account, why the source stopped the
    workers if it did, and the version the load itself declared (a transfer round's finish may
    name one; `declares` False keeps the plan's)."""

    results: list[LoadResult]
    aborted: tuple[Cause, str] | None = None
    declares: bool = False
    version: str | None = None

    def applied_to(self, plan: UpdatePlan) -> UpdatePlan:
        """The plan the update finishes with."""
        return replace(plan, version=self.version) if self.declares else plan


@dataclass(frozen=True)
class Staged:
    """What a source's stage ended with: the set's plan (a transfer round learns its tensors
    from the trainer's batches) and why the source stopped the workers, if it did."""

    plan: UpdatePlan
    aborted: tuple[Cause, str] | None = None


class UpdateSource(Protocol):
    """How one update's weights arrive (module docstring)."""

    @property
    def receives(self) -> bool:
        """The bytes cross the network as the workers load them (the Operation's phase shows
        RECEIVING until the first tensor is written)."""
        ...

    async def load(self, op: UpdateOperation, plan: UpdatePlan, deadline: float) -> Loaded:
        """Every worker of every rank loads `plan` into the model by `deadline` (wall clock);
        raises UpdateFailed when the load fails as a whole (a worker timed out)."""
        ...

    async def stage(self, op: UpdateOperation, plan: UpdatePlan, token: str, deadline: float, max_bytes: int) -> Staged:
        """Every worker receives `plan` into its staging memory under `token`, never into the
        model; at most `max_bytes` in all."""
        ...

    def abort(self, cause: Cause, message: str) -> None:
        """Stop the workers (CancelOperation, a broken stream, shutdown); never blocks. Before the
        load or stage began, remembered: they stop as they start."""
        ...

    async def failed(self, cause: str) -> None:
        """The update failed with `cause`: release what the failure broke (a broadcast group)."""
        ...

    def close(self) -> None:
        """The update ended: release what the source held for it (its channels, its group)."""
        ...
