"""WorkersRead: the source of an update whose workers read the weights themselves.

Runs in the `enginectl serve` process, on the control loop. Every worker of every rank reads
the plan on its own (worker/weights/readers/): a checkpoint on disk, the trainer's shared
memory (IPC), the trainer's broadcast group, the set it staged (a commit), or a tensor
stream's chunks, which the server feeds to each worker through the update's channels
(channels.py; the feed is tensor_stream.py's). The channels also carry aborts to the workers
and their progress back; they are opened when the load or stage begins and closed when the
update ends. A broadcast keeps its group in use while it runs, and drops it when the failure
broke it (groups.py). docs/architecture.md, "Update sources".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog
import zmq.asyncio

from enginectl.contract.engine import Cause, LoadPlan, Source, WorkerLayout
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.limits import RPC_GRACE_S
from enginectl.server.weights.engine_protocols import UpdateEngine
from enginectl.server.weights.sources.channels import ONE_HOST, ChannelSettings, DroppedFrames, UpdateChannels
from enginectl.server.weights.sources.groups import BREAKING_CAUSES, UpdateGroups
from enginectl.server.weights.update.operations import ProgressTally, UpdateOperation
from enginectl.server.weights.update.outcome import UpdateFailed
from enginectl.server.weights.update.plans import Loaded, Staged, UpdatePlan

log = structlog.get_logger("enginectl.staging")

QUIET_S = 2  # a stage whose progress channel is this quiet asks its workers how they are
# Sends the bytes of one update through its channels, beside the workers' load (a tensor stream).
Feed = Callable[[UpdateChannels, UpdateOperation], Awaitable[None]]


class WorkerSources:
    """Makes the workers' source of each update; owns the ZMQ context and the directory their
    channels bind in."""

    def __init__(
        self,
        engine: UpdateEngine,
        layout: WorkerLayout,
        groups: UpdateGroups,
        directory: Path,
        *,
        settings: ChannelSettings = ONE_HOST,
        dropped: DroppedFrames | None = None,
    ) -> None:
        self._engine = engine
        self._layout = layout
        self._groups = groups
        self._dir = directory
        self._settings = settings
        self._dropped = dropped if dropped is not None else DroppedFrames()
        self._ctx = zmq.asyncio.Context()

    def read(self, plan: UpdatePlan, feed: Feed | None = None) -> WorkersRead:
        """The source of `plan` (its broadcast group, if any, in use until the update ends)."""
        return WorkersRead(self, plan.group, feed)

    def channels(self) -> UpdateChannels:
        return UpdateChannels(self._ctx, self._dir, uuid.uuid4().hex, self._layout, self._settings, self._dropped)

    @property
    def engine(self) -> UpdateEngine:
        return self._engine

    @property
    def groups(self) -> UpdateGroups:
        return self._groups

    def close(self) -> None:
        self._ctx.destroy(0)


class WorkersRead:
    """One update's workers reading its weights (module docstring)."""

    def __init__(self, sources: WorkerSources, group: str, feed: Feed | None) -> None:
        self._sources = sources
        self._group = group
        self._feed = feed
        self._channels: UpdateChannels | None = None
        self._aborted: tuple[Cause, str] | None = None  # an abort before the channels opened
        if group:
            sources.groups.in_use.add(group)

    @property
    def receives(self) -> bool:
        return self._feed is not None or bool(self._group)

    def _open(self) -> UpdateChannels:
        channels = self._channels = self._sources.channels()
        if self._aborted is not None:
            channels.abort(*self._aborted)
        return channels

    def abort(self, cause: Cause, message: str) -> None:
        if self._channels is not None:
            self._channels.abort(cause, message)
        elif self._aborted is None:
            self._aborted = (cause, message)

    async def load(self, op: UpdateOperation, plan: UpdatePlan, deadline: float) -> Loaded:
        """Every worker of every rank loads; the timeout and the feed (a tensor stream's bytes)
        run beside the load, the progress reports go into the Operation's metadata."""
        channels = self._open()
        worker_plan = _worker_plan(plan, channels, deadline)
        engine = self._sources.engine
        load = asyncio.ensure_future(engine.load(worker_plan, timeout=plan.timeout + RPC_GRACE_S))
        progress = asyncio.ensure_future(op.follow_progress(ProgressTally(channels.layout), channels.next_progress))
        timer = _abort_at(channels, deadline, f"the update's timeout ({plan.timeout:.3f}s) elapsed")
        feeding = asyncio.ensure_future(self._feed(channels, op)) if self._feed is not None else None
        try:
            try:
                results = await load
            except ControlPlaneError as exc:
                if exc.reason != Reason.WORKER_TIMEOUT:
                    raise
                # A worker was still loading when the call's timeout passed: whatever it wrote
                # is unknown, so the weights count as mixed (docs/architecture.md).
                raise UpdateFailed(Cause.WORKER_TIMEOUT, exc.message, modified=True) from None
            if feeding is not None:
                await asyncio.wait({feeding}, timeout=1.0)
            return Loaded(results, aborted=channels.aborted)
        finally:
            timer.cancel()
            if feeding is not None and not feeding.done():
                feeding.cancel()
            progress.cancel()

    async def stage(self, op: UpdateOperation, plan: UpdatePlan, token: str, deadline: float, max_bytes: int) -> Staged:
        """Every worker starts a staging thread (worker/weights/staging.py) that receives the
        bytes into host memory under `token`, and reports `staged` on the progress channel;
        this waits for every report (or, the channel quiet, asks the workers directly). The
        plan was checked against `max_bytes` before the stage started (Staging.check)."""
        channels = self._open()
        engine = self._sources.engine
        timer = _abort_at(channels, deadline, f"the stage's timeout ({plan.timeout:.3f}s) elapsed")
        feeding: asyncio.Future[None] | None = None
        try:
            # What the workers receive (a stage plan names no stage token), kept under the set's.
            worker_plan = msgspec.structs.replace(_worker_plan(plan, channels, deadline), stage_token=token)
            acks = await engine.stage(worker_plan)
            if self._feed is not None:
                feeding = asyncio.ensure_future(self._feed(channels, op))
            workers = {(a.dp_rank, a.worker_rank) for rank in acks for a in rank}

            async def ended() -> bool:  # every worker's staging is over (asked, not reported)
                return all(r.done for rank in await engine.stage_result(token) for r in rank)

            try:
                await asyncio.wait_for(
                    _follow(op, channels, workers, ended), max(deadline - time.time(), 0) + RPC_GRACE_S
                )
            except asyncio.TimeoutError:
                raise UpdateFailed(
                    Cause.UPDATE_TIMEOUT, "a worker never reported the end of its staging", False
                ) from None
            return Staged(plan, channels.aborted)
        finally:
            timer.cancel()
            if feeding is not None and not feeding.done():
                await asyncio.wait({feeding}, timeout=1.0)
                feeding.cancel()

    async def failed(self, cause: str) -> None:
        """A broadcast whose failure broke its group (a peer gone, a timeout) drops it: the
        trainer creates it again."""
        if self._group and cause in BREAKING_CAUSES:
            await self._sources.groups.drop(self._group)

    def close(self) -> None:
        if self._channels is not None:
            self._channels.close()
        if self._group:
            self._sources.groups.in_use.discard(self._group)


def _abort_at(channels: UpdateChannels, deadline: float, message: str) -> asyncio.TimerHandle:
    """At `deadline` (wall clock), every worker gets an UPDATE_TIMEOUT abort frame."""
    loop = asyncio.get_running_loop()
    return loop.call_at(
        loop.time() + max(deadline - time.time(), 0.0), lambda: channels.abort(Cause.UPDATE_TIMEOUT, message)
    )


def _worker_plan(plan: UpdatePlan, channels: UpdateChannels, deadline: float) -> LoadPlan:
    """What every worker is asked to load, through `channels` (a commit: from the staged set
    `stage_token`)."""
    return LoadPlan(
        source=Source.STAGED if plan.stage_token else Source.of(plan.source),
        files=tuple(str(f) for f in plan.files),
        tensors=plan.specs(),
        group=plan.group,
        data_endpoints=channels.data_endpoints,
        progress_endpoint=channels.progress_endpoint,
        progress_tcp_endpoint=channels.progress_tcp_endpoint,
        first_worker=channels.layout.first_worker,
        key=channels.key,
        timeout_s=max(deadline - time.time(), 0.0),
        bucket_bytes=plan.bucket_bytes,
        handles=plan.handles,
        stage_token=plan.stage_token,
    )


async def _follow(
    op: UpdateOperation, channels: UpdateChannels, workers: set[tuple[int, int]], ended: Callable[[], Awaitable[bool]]
) -> None:
    """Fold the workers' progress into the metadata (weights_modified stays false: nothing
    is written into the model) until every worker in `workers` reported `staged`, or, when
    the channel stays quiet for QUIET_S, `ended()` says every worker's staging is over (a
    report can be lost: a worker gives up sending it after STAGED_SEND_TIMEOUT_MS)."""
    pending = set(workers)
    tally = ProgressTally(channels.layout)
    while pending:
        if not await channels.progress.poll(QUIET_S * 1000):
            if await ended():
                log.warning("staging ended without every worker's report", operation=op.name, missing=len(pending))
                return
            continue
        report = await channels.next_report()
        if report is None:
            continue
        if len(report) == 2:
            pending.discard((report[0], report[1]))
        else:
            op.record_progress(tally, *report, writing=False)
