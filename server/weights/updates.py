"""WeightUpdates: the long-lived state of weight updates, and what every RPC of the room asks of it.

Runs in the `enginectl serve` process, on the control loop. The room is split by concern
(docs/architecture.md, "Modules"): the version (version/: the ledger, fingerprints), the update
(update/: the run, generation and its pause paths, staging, outcome, plans, operations) and the
sources of weights (sources/: the workers' own reading with its channels, the tensor stream, the
transfer round, and the checks of each request). This object owns what outlives an update: the
generation pause state, the trainer's groups, the stage and its set, the fingerprints, the
validator and the request_id table; the servicers (services/) make one call into it per RPC.
`start` checks the rules before an update runs (docs/architecture.md, "The update state
machine": one update at a time, a retried request_id answers its first Operation, the ledger's
write lock taken before the Operation is returned), chooses the update's source once, then
starts one task per update: the stage (update/staging.py) or an UpdateRun (update/run.py),
which holds that update's own state.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import grpc
import structlog

from enginectl.contract.engine import Cause
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.weights.convert import source_proto, verify_response
from enginectl.server.weights.engine_protocols import UpdateEngine
from enginectl.server.weights.sources.channels import ONE_HOST, ChannelSettings, DroppedFrames
from enginectl.server.weights.sources.groups import UpdateGroups, backends
from enginectl.server.weights.sources.prepare import prepare
from enginectl.server.weights.sources.tensor_stream import TensorStream, read_header
from enginectl.server.weights.sources.validation import UpdateValidator
from enginectl.server.weights.sources.workers import WorkerSources
from enginectl.server.weights.update.generation import Generation
from enginectl.server.weights.update.operations import OperationStore, UpdateOperation
from enginectl.server.weights.update.outcome import report_finished
from enginectl.server.weights.update.plans import TensorInfo, UpdatePlan, UpdateSource
from enginectl.server.weights.update.run import RunParts, UpdateRun
from enginectl.server.weights.update.staging import DEFAULT_TTL_S, STAGED_PREFIX, StagedSet, Staging
from enginectl.server.weights.version.fingerprints import WeightFingerprints
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_service_pb2 as wvs_pb2

log = structlog.get_logger("enginectl.updates")


class WeightUpdates:
    """Generation pause state, weight updates and fingerprints of one engine."""

    def __init__(
        self,
        engine: UpdateEngine,
        ledger: WeightVersionLedger,
        store: OperationStore,
        *,
        allowed_roots: list[Path],
        expected: dict[str, TensorInfo],
        on_finished: Callable[[str, str, int, float], None] | None = None,
        on_pause: Callable[[str | None], None] | None = None,
        max_staged_bytes: int | None = None,
        staged_ttl: float = DEFAULT_TTL_S,
        on_staged_bytes: Callable[[int], None] | None = None,
        fingerprints: WeightFingerprints | None = None,
        on_partial: Callable[[bool], Awaitable[None]] | None = None,
        on_takeover: Callable[[str], None] | None = None,
        channels: ChannelSettings = ONE_HOST,
        dropped_frames: DroppedFrames | None = None,
        remote_ranks: Mapping[int, str] = MappingProxyType({}),
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._store = store
        # (source, result, bytes loaded, seconds) of every update that ends; result: "ok",
        # "failed", "partial" (failed after writing began) or "cancelled" (before it began).
        self._on_finished = on_finished
        self._ranks = engine.info.managed_ranks  # its DP ranks, by their engine-wide numbers
        self._dir = Path(tempfile.mkdtemp(prefix="enginectl-updates-"))
        self.generation = Generation(engine, self._ranks, on_pause, on_partial)
        # dp_rank -> host of the ranks on other hosts than this server's (the census; empty on
        # one host): what no IPC update and no loopback group can reach, named in refusals.
        self._remote_ranks = MappingProxyType(dict(remote_ranks))
        self.groups = UpdateGroups(engine, on_takeover, remote_ranks=self._remote_ranks)
        self.remote_ranks = self._remote_ranks  # read by the transfer engine's init (transfer.py)
        # The source of every update whose workers read the weights themselves (and of a
        # tensor stream, fed through their channels); a transfer round brings its own.
        # `channels`: where they listen (TCP for ranks on other hosts) and their key.
        self._sources = WorkerSources(
            engine, engine.info.layout, self.groups, self._dir, settings=channels, dropped=dropped_frames
        )
        self._validator = UpdateValidator(
            ledger,
            self.groups,
            allowed_roots=allowed_roots,
            expected=expected,
            served_dtype=engine.info.dtype,
            remote_ranks=self._remote_ranks,
        )
        # Built by the caller when the ledger's declarations need it before this object exists.
        self.fingerprints = fingerprints if fingerprints is not None else WeightFingerprints(engine)
        model_bytes = sum(t.nbytes for t in expected.values())
        self.staging = Staging(
            engine,
            ledger,
            max_bytes=max_staged_bytes if max_staged_bytes is not None else model_bytes,
            ttl=staged_ttl,
            on_bytes=on_staged_bytes,
        )
        self._parts = RunParts(engine, ledger, self.generation, self.fingerprints, self.staging, on_finished)
        # request_id -> (the plan's key, its Operation): a retry answers the first Operation.
        self._by_request_id: dict[str, tuple[tuple[object, ...], UpdateOperation]] = {}
        self._preparing = False  # an update's workers check its files (sources/prepare.py)

    @property
    def operations(self) -> OperationStore:
        return self._store

    @property
    def validator(self) -> UpdateValidator:
        return self._validator

    def check_version(self, version: str | None, etag: str) -> None:
        """A version to declare and the etag it is fenced with, checked (raises, changes nothing)."""
        self._ledger.check_write(version=version, etag=etag, request_id="")

    @property
    def allowed_roots(self) -> list[Path]:
        return self._validator.allowed_roots

    def close(self) -> None:
        if self.generation.active is not None:
            self.generation.active.cancel()
        self._sources.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def prepare(self) -> None:
        """Once, before serving: choose how generation is paused (Generation.prepare) and, from
        one sampled fingerprint (milliseconds), learn the methods GetServerInfo reports."""
        await self.generation.prepare()
        await self.fingerprints.sampled()

    # --- what GetServerInfo reports ----------------------------------------------------------

    def backends(self) -> list[pb2.UpdateBackend.ValueType]:
        """The update backends this server offers: not IPC when a rank runs on another host."""
        return [b for b in backends() if not (self._remote_ranks and b == pb2.UPDATE_BACKEND_IPC)]

    @property
    def fingerprint_method(self) -> str:
        return self.fingerprints.sampled_method

    @property
    def full_fingerprint_method(self) -> str:
        return self.fingerprints.full_method

    # --- one call per RPC --------------------------------------------------------------------

    async def pause(self, request: pb2.PauseGenerationRequest) -> pb2.PauseGenerationResponse:
        return await self.generation.pause(request)

    async def resume(self, request: pb2.ResumeGenerationRequest) -> pb2.ResumeGenerationResponse:
        return await self.generation.resume(request)

    async def generation_state(self) -> pb2.GenerationState:
        state = await self.generation.state()
        if self.staging.current is not None:
            state.staged.CopyFrom(self.staging.current.proto())
        return state

    def _receiving(self) -> str:
        """The Operation receiving through a group now: the running update, or the stage."""
        if self.generation.updating() and self.generation.active is not None:
            return self.generation.active.name
        current = self.staging.current
        return current.operation if current is not None else "an update"

    def _group_in_use(self, name: str) -> None:
        """Raises GROUP_IN_USE, naming the update, while one receives through `name`."""
        if name in self.groups.in_use:
            running = self._receiving()
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.GROUP_IN_USE,
                f"{running} is receiving through {name!r}: CancelOperation(name={running!r}) ends it and frees "
                "the name (a trainer that restarted then creates it again)",
                metadata={"operation": running},
            )

    async def init_group(self, request: pb2.InitWeightsUpdateGroupRequest, by: str = "") -> pb2.WeightsUpdateGroup:
        self._group_in_use(request.group_name)
        return await self.groups.init(request, by)

    async def destroy_group(self, request: pb2.DestroyWeightsUpdateGroupRequest) -> bool:
        self._group_in_use(request.group_name)
        return await self.groups.destroy(request)

    async def update_from_disk(self, request: pb2.UpdateWeightsFromDiskRequest, by: str = "") -> UpdateOperation:
        # Checking a checkpoint reads its safetensors headers: off the control loop.
        op, _ = await self.start((await asyncio.to_thread(self._validator.disk, request)).asked_by(by))
        return op

    async def update_from_distributed(
        self, request: pb2.UpdateWeightsFromDistributedRequest, by: str = ""
    ) -> UpdateOperation:
        op, _ = await self.start(self._validator.distributed(request).asked_by(by))
        return op

    async def update_from_ipc(self, request: pb2.UpdateWeightsFromIpcRequest, by: str = "") -> UpdateOperation:
        op, _ = await self.start(self._validator.ipc(request, self._engine.info.num_workers).asked_by(by))
        return op

    async def update_from_tensors(
        self, requests: AsyncIterator[pb2.UpdateWeightsFromTensorsRequest], by: str = ""
    ) -> UpdateOperation:
        """The tensor stream's update: its header planned, its chunks fed (tensor_stream.py).
        Answers once the stream is fed (or the update ended); raises the update's error if it
        failed meanwhile, and the store's if the server closes."""
        messages = requests.__aiter__()
        plan = self._validator.tensors(await read_header(messages)).asked_by(by)
        stream = TensorStream(messages, plan.bytes_total)
        op, started = await self.start(plan.arriving_by(self._sources.read(plan, stream.feed)))
        store = self._store
        if started:
            await stream.follow(
                op, store, lambda: op.abort(Cause.STREAM_BROKEN, "the client cancelled the stream or went away")
            )
        if op.done and op.failure is not None:
            raise op.failure
        if not op.done and store.closing.is_set():
            raise store.closed_error()
        return op

    async def commit(self, request: pb2.CommitStagedWeightsRequest, by: str = "") -> UpdateOperation:
        """CommitStagedWeights: an update of the staged set. A commit retried with its
        request_id answers the first one's Operation (its set may be consumed by now);
        REQUEST_ID_REUSED when that key named another update."""
        known = self._by_request_id.get(request.request_id) if request.request_id else None
        if known is not None:
            if known[0][-1] != request.name.removeprefix(STAGED_PREFIX):  # the key ends with the stage token
                raise invalid_field(Reason.REQUEST_ID_REUSED, "request_id", "already used by a different update")
            return known[1]
        staged = self.staging.find(request.name)
        op, _ = await self.start(self._validator.commit(request, staged.plan, staged.token).asked_by(by))
        return op

    async def discard(self, request: pb2.DiscardStagedWeightsRequest) -> pb2.DiscardStagedWeightsResponse:
        def cancel(name: str) -> None:
            op = self._store.find(name)
            if op is not None:
                op.cancel()

        found, freed = await self.staging.discard(request.name, request.allow_missing, cancel)
        return pb2.DiscardStagedWeightsResponse(found=found, bytes_freed=freed)

    async def verify(self, full: bool) -> wvs_pb2.VerifyWeightsResponse:
        """VerifyWeights: the weights now against the fingerprint the declaration recorded."""
        verdict, recorded, current = await self.fingerprints.verify(self._ledger.state, full)
        return verify_response(verdict, recorded, current, self._ledger.state)

    # --- starting an update ------------------------------------------------------------------

    async def start(self, plan: UpdatePlan) -> tuple[UpdateOperation, bool]:
        """Create the Operation and start the update; (operation, started). A retried
        request_id returns the first operation (started=False). The update's source is chosen
        here, once: the one the plan arrives by (a tensor stream, a transfer round), else the
        workers read the weights themselves (sources/workers.py).

        A disk update is prepared first (sources/prepare.py): every worker reads its files'
        headers as planned, else FAILED_PRECONDITION CHECKPOINT_NOT_ON_RANK, with no
        Operation and nothing paused or written.

        The ledger's write lock is taken here, before the Operation is returned, and held
        until the update is recorded: a declaration accepted after this call applies after
        the update, whatever it waits for (pausing included)."""
        if plan.request_id:
            known = self._by_request_id.get(plan.request_id)
            if known is not None:
                if known[0] != plan.key():
                    raise invalid_field(Reason.REQUEST_ID_REUSED, "request_id", "already used by a different update")
                return known[1], False
        if self.generation.updating():
            raise self.generation.in_progress("one update runs at a time")
        if self._preparing:
            raise ControlPlaneError(
                grpc.StatusCode.ABORTED,
                Reason.UPDATE_IN_PROGRESS,
                "another update is being prepared; one update runs at a time",
            )
        self.staging.check_idle()
        if plan.stage_token:
            self.staging.check_committable(plan.stage_token)
        if plan.stage_only:
            self.staging.check(plan)
        # Before anything is paused or written, and before the Operation exists: every worker
        # can read the plan's files as planned, else a clean refusal (sources/prepare.py).
        # The update slot is held meanwhile, so no other update's RPC queues behind this one.
        self._preparing = True
        try:
            await prepare(self._engine, plan, self._remote_ranks)
        finally:
            self._preparing = False
        source = plan.via if plan.via is not None else self._sources.read(plan)
        op_id = plan.request_id or str(uuid.uuid4())
        metadata = pb2.UpdateWeightsMetadata(
            phase=pb2.UPDATE_PHASE_VALIDATING,
            source=source_proto(plan.source),
            request_id=plan.request_id,
            tensors_total=len(plan.tensors),
            bytes_total=plan.bytes_total,
            ranks=[pb2.RankUpdateProgress(dp_rank=r, phase=pb2.UPDATE_PHASE_VALIDATING) for r in self._ranks],
        )
        if plan.version is not None:
            metadata.weight_version = plan.version
        metadata.start_time.FromNanoseconds(time.time_ns())
        op = UpdateOperation(f"operations/{op_id}", metadata, source)
        op.touch()
        self._store.add(op)
        if plan.request_id:
            self._by_request_id[plan.request_id] = (plan.key(), op)
        # A retry is answered while its Operation is still kept: forget the evicted ones.
        self._by_request_id = {
            rid: known for rid, known in self._by_request_id.items() if self._store.find(known[1].name) is known[1]
        }
        if plan.stage_only:  # no pause, no ledger lock: generation and declarations go on
            staged = self.staging.reserve(plan, op)
            asyncio.ensure_future(self._stage(staged, op, source))
            return op, True
        self.generation.update_began(op)  # from here on, another update is refused
        if plan.stage_token:  # from here on, a discard of the set is refused
            self.staging.commit_started(plan.stage_token, op.name)
        lock = self._ledger.writing()
        try:
            await lock.acquire()
        except asyncio.CancelledError:  # the caller went away before the update could start
            self.generation.update_ended(op)
            source.close()
            if plan.stage_token:
                self.staging.commit_ended(plan.stage_token, op.name)
            op.fail(
                ControlPlaneError(
                    grpc.StatusCode.CANCELLED,
                    Reason.UPDATE_CANCELLED,
                    "the call was cancelled before the update started",
                )
            )
            report_finished(self._on_finished, op, plan, "cancelled", 0)
            raise
        log.info(
            "weight update started",
            operation=op.name,
            request_id=plan.request_id,
            source=plan.source.value,
            version=plan.version,
            tensors=len(plan.tensors),
            caller=plan.by,
        )
        asyncio.ensure_future(UpdateRun(self._parts, op, plan, source, lock).run())
        return op, True

    async def _stage(self, staged: StagedSet, op: UpdateOperation, source: UpdateSource) -> None:
        plan = staged.plan
        log.info("weight stage started", operation=op.name, source=plan.source.value, tensors=len(plan.tensors))
        await self.staging.run(staged, op, source, time.monotonic())
