"""Fleet: one trainer, many rollout engines, one version (docs/weights.md, "The fleet").

Runs in the trainer process. No new server and no consensus service: the trainer is the single
writer of its fleet's version, and every server's own two-phase update does the rest.

1. `stage_*`: every server stages the same tensors while it keeps generating (the same disk
   path on each, a tensor stream to each, or ONE broadcast through one gloo/NCCL group that
   spans the trainer and every engine's workers, each server at its own rank offset). The
   etag each server's version had is kept as the commit's fence. If any stage fails, every
   staged set is discarded: no server changed.
2. `commit`: "strict" (default) pauses every server (KEEP), commits each with its etag, then
   resumes them all, so no server generates under the new version while another still
   generates under the old one; "loose" commits each on its own (every output still names
   the versions it was generated under). A server whose commit failed after writing began is
   quarantined by the server itself (paused, undeclared, gRPC health NOT_SERVING); one whose
   commit failed before writing is held paused on its old weights by the fleet. `repair()`
   re-commits the kept staged set on both kinds, from what the servers hold
   (fleet_repair.py): a trainer that restarted repairs with a new `Fleet(targets)`.
3. `status()` joins every server's version, generation state, staged set and health, and,
   given a Planner, the age of each rank's newest forward-pass-metrics sample.

AsyncFleet is built of two collaborators, made once in its constructor: FleetServers
(fleet_servers.py: a trainer client per server, the fan-out, the stage rules every way of
staging shares) and FleetTransfer (fleet_transfer.py: the fleet as vLLM's weight-sync client,
whose steps AsyncFleet forwards). `Fleet` is the blocking twin (the same methods, on a private
event-loop thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Unpack

import grpc

from enginectl.client._sync import LoopOwner, blocking, forwarded
from enginectl.client.client import ChannelOptions
from enginectl.client.errors import EnginectlError, Reason
from enginectl.client.fleet_repair import RepairUnclear, repair_version, repairs
from enginectl.client.fleet_servers import FleetServers
from enginectl.client.fleet_transfer import FleetTransfer
from enginectl.client.fleet_types import (
    FleetCommit,
    FleetCommitError,
    FleetError,
    FleetStage,
    FleetStageError,
    FleetStatus,
    RankStatus,
    ServerOutcome,
    ServerStatus,
)
from enginectl.client.master_address import refuse_loopback_master
from enginectl.client.planner import Planner, PlannerThread, RankState, latest_ranks
from enginectl.client.trainer import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, AsyncTrainerClient
from enginectl.client.trainer_requests import duration
from enginectl.client.trainer_tensors import BroadcastGroup, TensorSource, named_tensors, tensor_spec
from enginectl.client.trainer_types import StagedWeights, UpdateOperation, UpdateResult, Verification
from enginectl.common.buckets import cut
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

FLEET_GROUP = "enginectl-fleet"
MODES = ("strict", "loose")


def _transfer_of(fleet: AsyncFleet) -> FleetTransfer:
    return fleet._transfer


class AsyncFleet:
    """asyncio fleet of servers: `async with AsyncFleet(["h1:50051", "h2:50051"]) as f: ...`.
    It is also a vLLM weight-sync client over every server (fleet_transfer.py)."""

    def __init__(self, targets: Sequence[str], **config: Unpack[ChannelOptions]) -> None:
        if not targets or len(set(targets)) != len(targets):
            raise ValueError("a fleet needs one or more distinct targets")
        self._servers = FleetServers(targets, **config)
        self._transfer = FleetTransfer(self._servers)
        self.targets = self._servers.targets
        self.clients = self._servers.clients
        # The fleet's own calls (health, a fleet-wide group), on each client's connection.
        self.last_commit: FleetCommit | None = None
        self._group: BroadcastGroup | None = None
        # The transfer rounds' bounds, per server (None: the server's defaults): the whole
        # round, and the wait for the trainer's next step (see Fleet.set_transfer_rounds).
        self.transfer_timeout: float | None = None
        self.transfer_step_timeout: float | None = None

    @property
    def last_stage(self) -> FleetStage | None:
        """What every server staged last (what `commit` and `repair` apply by default)."""
        return self._servers.last_stage

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        await self._servers.close()

    # --- status --------------------------------------------------------------------------

    async def status(self, planner: Planner | PlannerThread | None = None) -> FleetStatus:
        """Every server's version, generation state (with its staged set), health and, with a
        `planner` following these servers, each rank's newest-sample age."""
        latest: list[RankState] = []
        if isinstance(planner, Planner):
            latest = planner.fleet.latest()
        elif isinstance(planner, PlannerThread):
            latest = await asyncio.to_thread(latest_ranks, planner)

        async def read(target: str, client: AsyncTrainerClient) -> ServerStatus:
            serving = await client.serving(timeout=client.config.timeout)
            version, generation = await asyncio.gather(client.get_weight_version(), client.generation_state())
            ranks = tuple(RankStatus(r.dp_rank, r.worker_id, r.age_s) for r in latest if r.endpoint == target)
            return ServerStatus(target, serving, version, generation, ranks)

        async def guarded(target: str, client: AsyncTrainerClient) -> ServerStatus:
            try:
                return await read(target, client)
            except EnginectlError as err:
                return ServerStatus(target, False, error=err)

        answers = await asyncio.gather(*(guarded(t, c) for t, c in self.clients.items()))
        return FleetStatus({s.target: s for s in answers})

    async def verify(self, full: bool = False) -> dict[str, Verification | EnginectlError]:
        """VerifyWeights on every server."""
        return await self._servers.each(lambda _, c: c.verify_weights(full))

    # --- stage ---------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "keep") -> dict[str, Any]:
        """PauseGeneration on every server at once (their PauseResults, by target). At once,
        never one after another: the servers of one hybrid load-balanced engine hold its
        ranks, and vLLM's MoE data-parallel pause and resume are collectives over every rank
        (docs/multinode.md, "One server per node"). FleetError naming the servers that failed;
        the others stay paused."""
        return _or_raise("pause", await self._servers.each(lambda _, c: c.pause_generation(mode)))

    async def resume_generation(self, force: bool = False) -> dict[str, Any]:
        """ResumeGeneration on every server at once (their GenerationStates, by target); see
        `pause_generation`."""
        return _or_raise("resume", await self._servers.each(lambda _, c: c.resume_generation(force)))

    async def stage_from_disk(
        self, path: str, version: str | None = None, *, timeout: float | None = None, progress: bool = False
    ) -> FleetStage:
        """Every server stages the safetensors at `path` (the same path on each);
        `progress` draws every server's bytes on one stderr line."""
        etags = await self._servers.etags()
        started = await self._servers.each(lambda _, c: c.start_stage_from_disk(path, version, timeout=timeout))
        outcomes = await self._servers.stage_results(started, progress)
        return await self._servers.staged(version, outcomes, etags)

    async def stage_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> FleetStage:
        """Every server stages `tensors` over its own tensor stream."""
        named = named_tensors(tensors)
        return await self._stage(
            version,
            lambda _, c: c.stage_weights_from_tensors(named, version, timeout=timeout, chunk_bytes=chunk_bytes),
        )

    async def init_weights_update_group(
        self,
        group_name: str = FLEET_GROUP,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
    ) -> dict[str, int]:
        """One group spanning this trainer (rank 0) and every engine's workers, server after
        server (the rank offsets it returns, by target): one broadcast feeds the fleet.

        FailedPreconditionError MASTER_ADDRESS_LOOPBACK, before anything is hosted or joined,
        when `master_address` is a loopback address and a rank of a server runs on another host
        than this process."""
        infos = await self._servers.infos()
        await refuse_loopback_master(master_address, infos)
        after, workers = await self._servers.worker_offsets(infos)
        offsets, world = {t: 1 + o for t, o in after.items()}, 1 + workers
        group = await asyncio.to_thread(
            BroadcastGroup.host, group_name, backend, master_address, master_port, world, timeout
        )

        async def join(target: str, client: AsyncTrainerClient) -> Any:
            return await client.join_update_group(group, master_address, offsets[target], timeout)

        joining = asyncio.ensure_future(asyncio.to_thread(group.join))
        joined = await self._servers.each(join)
        errors = {t: ServerOutcome(t, e) for t, e in joined.items() if isinstance(e, EnginectlError)}
        if errors:
            group.close()
            joining.add_done_callback(lambda f: f.cancelled() or f.exception())
            await self._servers.each(lambda _, c: c.destroy_weights_update_group(group_name, allow_missing=True))
            raise FleetError("not every server joined the group", errors)
        await joining
        self._group = group
        return offsets

    async def destroy_weights_update_group(self, group_name: str = FLEET_GROUP) -> None:
        """Leave the fleet's group: this trainer's end closes and every server's workers leave
        it (a server without it is not an error). FleetError naming the servers that failed."""
        if self._group is not None and self._group.name == group_name:
            self._group.close()
            self._group = None
        left = await self._servers.each(lambda _, c: c.destroy_weights_update_group(group_name, allow_missing=True))
        errors = {t: ServerOutcome(t, e) for t, e in left.items() if isinstance(e, EnginectlError)}
        if errors:
            raise FleetError(f"not every server left the group {group_name!r}", errors)

    async def stage_broadcast(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        timeout: float | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        progress: bool = False,
    ) -> FleetStage:
        """Every server stages `tensors` from ONE broadcast through the fleet's group
        (init_weights_update_group first)."""
        group = self._group
        if group is None:
            raise ValueError("no fleet group: call init_weights_update_group first")
        named = named_tensors(tensors, group.device)
        request = pb2.UpdateWeightsFromDistributedRequest(
            group_name=group.name, tensors=[tensor_spec(n, t) for n, t in named], bucket_bytes=bucket_bytes
        )
        request.stage_only = True
        if version is not None:
            request.weight_version = version
        if timeout is not None:
            request.timeout.CopyFrom(duration(timeout))

        async def start(target: str, client: AsyncTrainerClient) -> UpdateOperation:
            return await client.start_distributed_update(request)

        etags = await self._servers.etags()
        started = await self._servers.each(start)
        if any(isinstance(op, EnginectlError) for op in started.values()):
            # Nobody broadcasts: stop the stages that began (their workers wait for data).
            await self._servers.each(
                lambda t, c: c.cancel_operation(started[t].name),  # type: ignore[union-attr]
                [t for t, op in started.items() if not isinstance(op, EnginectlError)],
            )
            outcomes = await self._servers.stage_results(started)
            await self._servers.discard_all(outcomes)
            raise FleetStageError("a server refused the stage; nothing was broadcast", outcomes)
        sizes = [t.numel() * t.element_size() for _, t in named]
        sending = asyncio.to_thread(group.broadcast, [t for _, t in named], cut(sizes, bucket_bytes))
        sent, outcomes = await asyncio.gather(
            asyncio.gather(sending, return_exceptions=True), self._servers.stage_results(started, progress)
        )
        if isinstance(sent[0], BaseException) and all(o.ok for o in outcomes.values()):
            outcomes = {t: ServerOutcome(t, _local_error(sent[0])) for t in outcomes}
        return await self._servers.staged(version, outcomes, etags)

    async def _stage(
        self, version: str | None, stage: Callable[[str, AsyncTrainerClient], Awaitable[StagedWeights]]
    ) -> FleetStage:
        etags = await self._servers.etags()
        answers = await self._servers.each(stage)
        outcomes = {
            t: ServerOutcome(t, a) if isinstance(a, EnginectlError) else ServerOutcome(t, staged=a)
            for t, a in answers.items()
        }
        return await self._servers.staged(version, outcomes, etags)

    async def discard(self, stage: FleetStage | None = None) -> None:
        """Drop the staged sets of `stage` (default: the last) on every server."""
        stage = stage or self.last_stage
        if stage is not None:
            await self._servers.discard_all(stage.outcomes)

    async def discard_staged(self) -> dict[str, int]:
        """Drop whatever set every server holds now, the fleet's or not (a trainer that
        restarted clears what its previous life staged); bytes freed, by target."""

        async def drop(_: str, client: AsyncTrainerClient) -> int:
            staged = (await client.generation_state()).staged
            return 0 if staged is None else await client.discard_staged_weights(staged.name, allow_missing=True)

        freed = await self._servers.each(drop)
        return {t: f if isinstance(f, int) else 0 for t, f in freed.items()}

    # --- commit --------------------------------------------------------------------------

    async def commit(
        self,
        stage: FleetStage | None = None,
        version: str | None = None,
        *,
        mode: str = "strict",
        fence: bool = True,
        timeout: float | None = None,
    ) -> FleetCommit:
        """Apply `stage` (default: the last) on every server and declare `version` (None: the
        stage's). `fence`: each commit only while its server still serves the version it had
        when staging began. Raises FleetCommitError (with every server's outcome) unless every
        commit succeeded; see `repair`."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        stage = stage or self.last_stage
        if stage is None:
            raise ValueError("nothing staged: stage first")
        version = version if version is not None else stage.version
        barrier = mode == "strict"
        if barrier:
            paused = await self._servers.each(lambda _, c: c.pause_generation("keep"))
            failed = {t: ServerOutcome(t, e) for t, e in paused.items() if isinstance(e, EnginectlError)}
            if failed:
                await self._servers.each(lambda _, c: c.resume_generation(), [t for t in paused if t not in failed])
                raise FleetCommitError("could not pause every server; nothing was committed", failed)

        async def apply(target: str, client: AsyncTrainerClient) -> UpdateResult:
            staged = stage.staged[target]
            etag = stage.etags.get(target) if fence else None
            return await client.commit_staged_weights(staged.name, version, etag=etag, timeout=timeout)  # type: ignore[return-value]

        answers = await self._servers.each(apply)
        outcomes = {t: self._commit_outcome(t, a) for t, a in answers.items()}
        if barrier:  # every commit ended: resume the ones that hold the new version, together
            await self._servers.each(lambda _, c: c.resume_generation(), [t for t, o in outcomes.items() if o.ok])
        self.last_commit = FleetCommit(version, mode, outcomes)
        if not self.last_commit.ok:
            raise FleetCommitError("a commit failed; see outcomes and repair()", outcomes)
        return self.last_commit

    @staticmethod
    def _commit_outcome(target: str, answer: UpdateResult | EnginectlError) -> ServerOutcome:
        if isinstance(answer, EnginectlError):
            state = "quarantined" if answer.reason == Reason.PARTIAL_UPDATE else "held"
            return ServerOutcome(target, answer, state=state)
        return ServerOutcome(target, result=answer)

    async def repair(self, version: str | None = None, *, timeout: float | None = None) -> FleetCommit:
        """Bring every server to the fleet's version from what the servers hold (fleet_repair.py),
        so a fresh process repairs as well as the one whose commit failed: a quarantined or held
        server re-commits its staged set, fenced by its version now, and resumes; a server left
        paused on the version resumes. `version`: the one to repair to (default: this process's
        last failed commit's, else the one the servers name). Returns the repaired servers'
        outcomes; raises FleetCommitError naming each server it could not repair, and
        FleetError when the servers can not be read or name no one version."""
        status = await self.status()
        unread = {t: ServerOutcome(t, s.error) for t, s in status.servers.items() if s.error is not None}
        if unread:
            raise FleetError("could not read every server; nothing was repaired", unread)
        last = self.last_commit
        if version is None and last is not None and not last.ok:
            version = last.version
        if version is None:
            if status.consistent:
                return FleetCommit(next(iter(status.versions)), "repair", {})
            try:
                version = repair_version(status)
            except RepairUnclear as err:
                raise FleetError(str(err), {}) from None
        plan = repairs(status, version)
        stuck = {
            t: ServerOutcome(t, EnginectlError(grpc.StatusCode.FAILED_PRECONDITION, r.why, Reason.NOT_REPAIRABLE))
            for t, r in plan.items()
            if not r.action
        }

        async def again(target: str, client: AsyncTrainerClient) -> UpdateResult | None:
            result = None
            if plan[target].action == "commit":
                now = await client.get_weight_version()
                committed = await client.commit_staged_weights(
                    plan[target].staged, version, etag=now.etag, timeout=timeout
                )
                assert isinstance(committed, UpdateResult)  # waited for (no `wait=False`)
                result = committed
            await client.resume_generation()  # the fleet's barrier pause, if it still holds
            return result

        answers = await self._servers.each(again, [t for t, r in plan.items() if r.action])
        repaired = {
            t: self._commit_outcome(t, a) if isinstance(a, EnginectlError) else ServerOutcome(t, result=a)
            for t, a in answers.items()
        }
        if last is not None and last.version == version:
            self.last_commit = FleetCommit(version, last.mode, {**last.outcomes, **repaired})
        outcomes = {**repaired, **stuck}
        if not all(o.ok for o in outcomes.values()):
            raise FleetCommitError("repair failed on some server", outcomes)
        return FleetCommit(version, "repair", repaired)

    async def update_from_disk(
        self, path: str, version: str, *, mode: str = "strict", fence: bool = True, progress: bool = False
    ) -> FleetCommit:
        """stage_from_disk, then commit: no server changes unless every server staged (see
        commit for what a failed commit leaves)."""
        stage = await self.stage_from_disk(path, version, progress=progress)
        return await self.commit(stage, mode=mode, fence=fence)

    # --- vLLM's weight-sync client over every server (fleet_transfer.py) ----------------

    async def start_weight_update(self) -> None:
        """A staging round on every server, bounded by `transfer_timeout` and
        `transfer_step_timeout` (fleet_transfer.py)."""
        await self._transfer.start_weight_update(self.transfer_timeout, self.transfer_step_timeout)

    transfer_world_size = forwarded(_transfer_of, FleetTransfer.transfer_world_size)
    init_weight_transfer_engine = forwarded(_transfer_of, FleetTransfer.init_weight_transfer_engine)
    update_weights = forwarded(_transfer_of, FleetTransfer.update_weights)
    finish_weight_update = forwarded(_transfer_of, FleetTransfer.finish_weight_update)
    shutdown_weight_transfer_engine = forwarded(_transfer_of, FleetTransfer.shutdown_weight_transfer_engine)


FleetError_ = FleetStageError  # a setup step (reading servers, joining a group) failed


def _or_raise(step: str, answers: dict[str, Any]) -> dict[str, Any]:
    errors = {t: ServerOutcome(t, a) for t, a in answers.items() if isinstance(a, EnginectlError)}
    if errors:
        raise FleetError(f"could not {step} every server", errors)
    return answers


def _local_error(exc: BaseException) -> EnginectlError:
    return EnginectlError(grpc.StatusCode.UNAVAILABLE, f"the broadcast failed: {type(exc).__name__}: {exc}")


class Fleet(LoopOwner[AsyncFleet]):
    """Blocking fleet with the methods of AsyncFleet; a context manager."""

    def __init__(self, targets: Sequence[str], **config: Unpack[ChannelOptions]) -> None:
        async def make() -> AsyncFleet:
            return AsyncFleet(targets, **config)

        super().__init__("enginectl-Fleet", make)
        self.targets = self._core.targets

    @property
    def last_stage(self) -> FleetStage | None:
        return self._core.last_stage

    @property
    def last_commit(self) -> FleetCommit | None:
        return self._core.last_commit

    status = blocking(AsyncFleet.status)
    verify = blocking(AsyncFleet.verify)
    stage_from_disk = blocking(AsyncFleet.stage_from_disk)
    stage_from_tensors = blocking(AsyncFleet.stage_from_tensors)
    init_weights_update_group = blocking(AsyncFleet.init_weights_update_group)
    destroy_weights_update_group = blocking(AsyncFleet.destroy_weights_update_group)
    pause_generation = blocking(AsyncFleet.pause_generation)
    resume_generation = blocking(AsyncFleet.resume_generation)
    stage_broadcast = blocking(AsyncFleet.stage_broadcast)
    discard = blocking(AsyncFleet.discard)
    discard_staged = blocking(AsyncFleet.discard_staged)
    commit = blocking(AsyncFleet.commit)
    repair = blocking(AsyncFleet.repair)
    update_from_disk = blocking(AsyncFleet.update_from_disk)
    # vLLM's VLLMWeightSyncClient protocol over every server (fleet_transfer.py): pass the
    # fleet as a trainer-side transfer engine's `client`.
    transfer_world_size = blocking(AsyncFleet.transfer_world_size)
    init_weight_transfer_engine = blocking(AsyncFleet.init_weight_transfer_engine)
    start_weight_update = blocking(AsyncFleet.start_weight_update)
    update_weights = blocking(AsyncFleet.update_weights)
    finish_weight_update = blocking(AsyncFleet.finish_weight_update)
    shutdown_weight_transfer_engine = blocking(AsyncFleet.shutdown_weight_transfer_engine)

    def set_transfer_rounds(self, timeout: float | None = None, step_timeout: float | None = None) -> None:
        """The next rounds' timeout (whole round) and step timeout (see fleet_transfer.py)."""
        self._core.transfer_timeout, self._core.transfer_step_timeout = timeout, step_timeout
