"""Broadcast updates: the trainer's update groups, and a broadcast update in flight.

Runs in the trainer process. `BroadcastUpdates` holds the trainer's groups by name and starts
the updates broadcast through them; AsyncTrainerClient (client/trainer.py) holds one and
forwards its group and broadcast methods to it. `AsyncBroadcast` (and its blocking view
`Broadcast`) is one such update in flight.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from enginectl.client._sync import LoopThread, blocking
from enginectl.client.master_address import refuse_loopback_master
from enginectl.client.trainer_operations import require_done
from enginectl.client.trainer_requests import GRACE_S, UpdateOptions
from enginectl.client.trainer_tensors import (
    DEFAULT_BUCKET_BYTES,
    BroadcastGroup,
    TensorSource,
    named_tensors,
    tensor_spec,
)
from enginectl.client.trainer_types import (
    TrainerCalls,
    UpdateOperation,
    UpdateResult,
    WeightsUpdateGroup,
)
from enginectl.common.buckets import cut
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

DEFAULT_GROUP = "enginectl-trainer"
# How long a send waits for its thread once the Operation ended successfully: the server had
# every bucket, so the thread only has to return from its last collective. One that takes
# longer is stuck, not slow, and its group is abandoned.
SENDER_RETURN_S = 5.0


class AsyncBroadcast:
    """An UpdateWeightsFromDistributed in flight: the trainer broadcasts `tensors` in order
    through its group (`send`), then waits for the Operation (`wait`). With `bucket_bytes`
    (the request's), tensors go in buckets cut by common/buckets.py, exactly as every engine
    worker cuts them."""

    def __init__(
        self,
        client: TrainerCalls,
        group: BroadcastGroup,
        operation: UpdateOperation,
        tensors: list[Any],
        options: UpdateOptions,
        progress: bool,
        bucket_bytes: int = 0,
    ) -> None:
        self.client, self.group, self.operation = client, group, operation
        self.options, self.progress = options, progress
        self._tensors = tensors
        self._buckets = cut([t.numel() * t.element_size() for t in tensors], bucket_bytes)
        self.sent = 0
        self._stop = threading.Event()

    @property
    def name(self) -> str:
        return self.operation.name

    @property
    def remaining(self) -> int:
        return len(self._tensors) - self.sent

    async def send(self, count: int | None = None) -> int:
        """Broadcast the next `count` tensors (all remaining by default), rounded up to the
        end of the bucket the last one is in; returns how many were sent. If the Operation
        ends with an error first (cancelled, timed out), raises it; one that succeeded
        before this thread returned from the last bucket is the send's success."""
        end = self.sent + (self.remaining if count is None else count)
        batch = [b for b in self._buckets if b.start >= self.sent and b.start < end]
        sending = asyncio.ensure_future(asyncio.to_thread(self.group.broadcast, self._tensors, batch, self._stop))
        ended = asyncio.ensure_future(self.client.wait_operation(self.name))
        try:
            await asyncio.wait({sending, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if not sending.done() and ended.exception() is None:
            op = ended.result()
            if op.done and op.error is None:
                # The server had every bucket and answered before this thread was seen to
                # return from the last one (a busy CPU): the send succeeded once it returns.
                await asyncio.wait({sending}, timeout=SENDER_RETURN_S)
        if not sending.done():
            # The server gave up on the broadcast, or the thread is stuck after it succeeded:
            # this group's collectives can not be trusted.
            self._stop.set()
            self.group.abandon("the update ended while broadcasting")
            sending.add_done_callback(lambda f: f.exception())
            op = ended.result()  # raises when waiting for the Operation failed
            if op.error is not None:
                raise op.error
            raise RuntimeError(f"{self.name} ended while tensors were still being broadcast")
        try:
            self.sent += sending.result()
        except Exception:
            self.group.abandon(self.group.broken)
            # The peers went away because the server ended the update (cancel, timeout, a
            # failed load): its error says why, better than gloo's "connection closed".
            op = await self.client.wait_operation(self.name, 30.0)
            if op.done and op.error is not None:
                raise op.error from None
            raise
        return sum(b.stop - b.start for b in batch)

    async def wait(self, timeout: float | None = None) -> UpdateResult:
        """Wait for the Operation; its result, or its error raised."""
        bound = timeout if timeout is not None else self.options.wait_bound()
        return require_done(await self.client.wait_operation(self.name, bound, progress=self.progress), bound).result()


class Broadcast:
    """Blocking view of AsyncBroadcast (from TrainerClient.start_broadcast)."""

    def __init__(self, loop: LoopThread, inner: AsyncBroadcast) -> None:
        self._loop, self._core = loop, inner

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def operation(self) -> UpdateOperation:
        """The Operation as it was when the broadcast started."""
        return self._core.operation

    @property
    def sent(self) -> int:
        return self._core.sent

    @property
    def remaining(self) -> int:
        return self._core.remaining

    send = blocking(AsyncBroadcast.send)
    wait = blocking(AsyncBroadcast.wait)


class BroadcastUpdates:
    """The trainer's update groups (rank 0 of each, by name) and the broadcast updates sent
    through them. A group whose broadcast failed or was cut short is abandoned: it is gone."""

    def __init__(self, client: TrainerCalls, stub: pb2_grpc.WeightUpdateServiceStub) -> None:
        self._client, self._connection, self._stub = client, client.connection, stub
        self._groups: dict[str, BroadcastGroup] = {}

    def close(self) -> None:
        """Close every group."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()

    def _usable(self, name: str) -> BroadcastGroup | None:
        group = self._groups.get(name)
        if group is not None and group.broken:
            del self._groups[name]
            return None
        return group

    async def init_weights_update_group(
        self,
        group_name: str = DEFAULT_GROUP,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        *,
        backend: str = "gloo",
        rank_offset: int = 1,
        world_size: int | None = None,
        timeout: float = 60.0,
    ) -> WeightsUpdateGroup:
        """Create the private group `group_name` with the server: this process is rank 0 and
        hosts its TCPStore at master_address:master_port (0: a free port); the engine's
        workers join as ranks rank_offset.. . Returns once every member joined.

        FailedPreconditionError MASTER_ADDRESS_LOOPBACK, before anything is hosted or joined,
        when `master_address` is a loopback address and a rank of the server runs on another
        host than this process (its workers would dial their own loopback)."""
        info = await self._client.get_server_info()
        await refuse_loopback_master(master_address, {self._connection.config.target: info})
        if world_size is None:
            world_size = rank_offset + info.num_workers
        group = await asyncio.to_thread(
            BroadcastGroup.host, group_name, backend, master_address, master_port, world_size, timeout
        )
        joining = asyncio.ensure_future(asyncio.to_thread(group.join))
        calling = asyncio.ensure_future(self.join_server(group, master_address, rank_offset, timeout))
        await asyncio.wait({joining, calling}, return_when=asyncio.FIRST_EXCEPTION)
        if calling.done() and calling.exception() is not None or joining.done() and joining.exception() is not None:
            # The server's answer says best what went wrong; a join left blocked ends at its timeout.
            joining.add_done_callback(lambda f: f.exception())
            group.close()
            await calling  # raises the server's error if it has one
            await joining
        joined = await calling
        await joining
        self._groups[group_name] = group
        return joined

    async def join_server(
        self, group: BroadcastGroup, master_address: str, rank_offset: int, timeout: float
    ) -> WeightsUpdateGroup:
        """InitWeightsUpdateGroup: the server's workers join `group`, which this process hosts
        (its own, or a fleet's spanning many servers), as ranks rank_offset..; answers once
        they joined. The caller runs the group's own join (`group.join`) beside it."""
        request = group.join_request(master_address, rank_offset)
        response = await self._connection.unary(self._stub.InitWeightsUpdateGroup, request, timeout + GRACE_S)
        g = response.group
        return WeightsUpdateGroup(
            g.group_name,
            group.backend,
            g.master_address,
            g.master_port,
            g.world_size,
            g.rank_offset,
            g.num_engine_ranks,
        )

    async def start_distributed(self, request: pb2.UpdateWeightsFromDistributedRequest) -> UpdateOperation:
        """UpdateWeightsFromDistributed as `request` says, through a group this helper does not
        hold (a fleet's): the update started, waiting for the broadcast."""
        return UpdateOperation.from_proto(
            await self._connection.unary(self._stub.UpdateWeightsFromDistributed, request, None)
        )

    async def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, *, allow_missing: bool = False, timeout: float | None = None
    ) -> bool:
        """Destroy the group on the server and locally; False when the server had none
        (with `allow_missing`)."""
        group = self._groups.pop(group_name, None)
        if group is not None:
            group.abandon("destroyed")
        response = await self._connection.unary(
            self._stub.DestroyWeightsUpdateGroup,
            pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name, allow_missing=allow_missing),
            timeout,
        )
        return bool(response.found)

    async def start_broadcast(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        group_name: str = DEFAULT_GROUP,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        stage_only: bool = False,
    ) -> AsyncBroadcast:
        """Start UpdateWeightsFromDistributed for `tensors` (in their order); broadcast them
        with `send()` and wait with `wait()`. broadcast_weights does all three. Tensors of at
        most `bucket_bytes` go packed in buckets, one collective each (0: one per tensor).
        `stage_only`: the engine stages them (see stage_broadcast_weights)."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout, stage_only)
        return await self.start(tensors, options, group_name, progress, bucket_bytes)

    async def broadcast_weights(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        group_name: str = DEFAULT_GROUP,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> UpdateResult:
        """Broadcast `tensors` (nn.Module, state dict or pairs; checkpoint names) through the
        group and declare `version` on success; returns the UpdateResult or raises."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        return await self.run(tensors, options, group_name, progress, bucket_bytes)

    async def start(
        self, tensors: TensorSource, options: UpdateOptions, group_name: str, progress: bool, bucket_bytes: int
    ) -> AsyncBroadcast:
        """UpdateWeightsFromDistributed for `tensors` through the local group `group_name`,
        started: the broadcast, its tensors still to send."""
        group = self._usable(group_name)
        if group is None:
            raise ValueError(f"no local group {group_name!r}: call init_weights_update_group first")
        named = named_tensors(tensors, group.device)
        request = options.fill(
            pb2.UpdateWeightsFromDistributedRequest(
                group_name=group_name, tensors=[tensor_spec(n, t) for n, t in named], bucket_bytes=bucket_bytes
            )
        )
        op = await self.start_distributed(request)
        return AsyncBroadcast(self._client, group, op, [t for _, t in named], options, progress, bucket_bytes)

    async def run(
        self, tensors: TensorSource, options: UpdateOptions, group_name: str, progress: bool, bucket_bytes: int
    ) -> UpdateResult:
        """`start`, then every tensor sent and the Operation waited for: its result, or its
        error raised."""
        broadcast = await self.start(tensors, options, group_name, progress, bucket_bytes)
        await broadcast.send()
        return await broadcast.wait()
