"""Trainer client: load new weights into a serving engine and know which version it serves.

Runs in the trainer process. `AsyncTrainerClient` (asyncio) extends `AsyncClient` with
WeightUpdateService, VerifyWeights and google.longrunning.Operations; `TrainerClient` extends
`Client` with the same methods blocking (the async ones, run on its event-loop thread).
`AsyncBroadcast` (and its blocking view `Broadcast`, both in trainer_broadcast.py) is a broadcast
update in flight.

    with TrainerClient("127.0.0.1:50051") as t:
        t.update_weights_from_disk("/ckpt/step-42", "step-42", progress=True)
        t.update_weights_from_tensors(model, "step-43")
        t.init_weights_update_group("g")
        t.broadcast_weights(model, "step-44")

torch is imported only by the calls that handle tensors (see trainer_tensors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Literal, Unpack, overload

import grpc

from enginectl.client._sync import blocking, entering
from enginectl.client.client import DEFAULT_TARGET, ChannelOptions, Client
from enginectl.client.errors import from_rpc_error
from enginectl.client.trainer_broadcast import AsyncBroadcast, Broadcast
from enginectl.client.trainer_ipc import update_from_ipc, zero_copy_update
from enginectl.client.trainer_requests import GRACE_S, UpdateOptions, duration, parse_pause_mode
from enginectl.client.trainer_staging import AsyncStagingMixin
from enginectl.client.trainer_tensors import (
    BACKENDS,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    BroadcastGroup,
    TensorSource,
    chunks,
    named_tensors,
    tensor_spec,
)
from enginectl.client.trainer_types import (
    GenerationState,
    PauseResult,
    ServerInfo,
    UpdateOperation,
    UpdateResult,
    Verification,
    WeightsUpdateGroup,
)
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2

DEFAULT_GROUP = "enginectl-trainer"


class AsyncTrainerClient(AsyncStagingMixin):
    """asyncio trainer client: `async with AsyncTrainerClient("host:port") as t: ...`."""

    def __init__(self, target: str = DEFAULT_TARGET, **config: Unpack[ChannelOptions]) -> None:
        super().__init__(target, **config)
        self._updates = pb2_grpc.WeightUpdateServiceStub(self._channel)
        self._groups: dict[str, BroadcastGroup] = {}
        self._info: ServerInfo | None = None

    async def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()
        await super().close()

    # --- server, generation, verification ------------------------------------------

    async def get_server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """Model, parallelism, backends, limits of the server (no engine round trip)."""
        self._info = ServerInfo.from_proto(
            await self._unary(self._updates.GetServerInfo, pb2.GetServerInfoRequest(), timeout)
        )
        return self._info

    async def generation_state(self, *, timeout: float | None = None) -> GenerationState:
        """Whether generation is paused, why, and the request counts per rank."""
        response = await self._unary(self._updates.GetGenerationState, pb2.GetGenerationStateRequest(), timeout)
        return GenerationState.from_proto(response.state)

    async def pause_generation(
        self,
        mode: str = "keep",
        *,
        clear_cache: bool = False,
        wait_timeout: float | None = None,
        timeout: float | None = None,
    ) -> PauseResult:
        """Pause generation on every rank ("keep" freezes requests, "abort" ends them,
        "wait" drains them within `wait_timeout`). It stays paused across updates."""
        request = pb2.PauseGenerationRequest(mode=parse_pause_mode(mode), clear_cache=clear_cache)
        if wait_timeout is not None:
            request.wait_timeout.CopyFrom(duration(wait_timeout))
        if timeout is None and wait_timeout is not None:
            timeout = wait_timeout + self.config.timeout
        return PauseResult.from_proto(await self._unary(self._updates.PauseGeneration, request, timeout))

    async def resume_generation(self, force: bool = False, *, timeout: float | None = None) -> GenerationState:
        """Resume generation; `force` also after a partial update (mixed weights)."""
        response = await self._unary(self._updates.ResumeGeneration, pb2.ResumeGenerationRequest(force=force), timeout)
        return GenerationState.from_proto(response.state)

    @contextlib.asynccontextmanager
    async def paused(
        self, mode: str = "keep", *, clear_cache: bool = False, wait_timeout: float | None = None
    ) -> AsyncIterator[PauseResult]:
        """Generation paused inside the block (e.g. around several bucketed updates), resumed
        after it, also when the block raises."""
        result = await self.pause_generation(mode, clear_cache=clear_cache, wait_timeout=wait_timeout)
        try:
            yield result
        finally:
            await self.resume_generation()

    async def verify_weights(self, full: bool = False, *, timeout: float | None = None) -> Verification:
        """Fingerprint the weights in memory on every rank and compare with the declaration."""
        response = await self._unary(self._versions.VerifyWeights, wv_pb2.VerifyWeightsRequest(full=full), timeout)
        return Verification.from_proto(response)

    # --- updates -----------------------------------------------------------------------

    @overload
    async def update_weights_from_disk(
        self,
        path: str,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        wait: Literal[True] = True,
    ) -> UpdateResult: ...

    @overload
    async def update_weights_from_disk(
        self,
        path: str,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        wait: Literal[False],
    ) -> UpdateOperation: ...

    @overload
    async def update_weights_from_disk(
        self,
        path: str,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        wait: bool = True,
    ) -> UpdateResult | UpdateOperation: ...

    async def update_weights_from_disk(
        self,
        path: str,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
        wait: bool = True,
    ) -> UpdateResult | UpdateOperation:
        """Load safetensors at `path` (on the server, under an allowed root) and declare
        `version` on success (None: the version becomes undeclared). Returns the
        UpdateResult (`wait=False`: the running UpdateOperation); raises the update's error
        as an EnginectlError. `progress=True` draws a progress bar on stderr."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        request = options.fill(pb2.UpdateWeightsFromDiskRequest(path=str(path)))
        op = UpdateOperation.from_proto(await self._unary(self._updates.UpdateWeightsFromDisk, request, None))
        return await self._finish(op, options, progress, wait)

    @overload
    async def update_weights_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: bool = False,
        wait: Literal[True] = True,
        zero_copy: bool = False,
    ) -> UpdateResult: ...

    @overload
    async def update_weights_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: bool = False,
        wait: Literal[False],
    ) -> UpdateOperation: ...

    @overload
    async def update_weights_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: bool = False,
        wait: bool = True,
        zero_copy: bool = False,
    ) -> UpdateResult | UpdateOperation: ...

    async def update_weights_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: bool = False,
        wait: bool = True,
        zero_copy: bool = False,
    ) -> UpdateResult | UpdateOperation:
        """Send `tensors` (an nn.Module, a state dict or (name, tensor) pairs; checkpoint
        names) over the UpdateWeightsFromTensors stream: a header, then the raw bytes in
        chunks of `chunk_bytes` (1..4 MiB). Returns as update_weights_from_disk. With
        `zero_copy` and a loopback or unix target, by reference instead, as
        update_weights_from_ipc (falling back to the stream if the server refuses it)."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        if zero_copy and (result := await zero_copy_update(self, tensors, options, progress, wait)) is not None:
            return result
        op = await self._stream_tensors(tensors, options, chunk_bytes)
        return await self._finish(op, options, progress, wait)

    async def _stream_tensors(self, tensors: TensorSource, options: UpdateOptions, chunk_bytes: int) -> UpdateOperation:
        """UpdateWeightsFromTensors: the header, then every byte; the Operation it started."""
        if not 0 < chunk_bytes <= 4 * 1024 * 1024:
            raise ValueError("chunk_bytes must be in 1..4 MiB")
        named = named_tensors(tensors)
        header = options.fill(pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named]))

        def messages() -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
            yield pb2.UpdateWeightsFromTensorsRequest(header=header)
            yield from chunks(named, chunk_bytes)

        try:
            response = await self._updates.UpdateWeightsFromTensors(
                messages(), timeout=options.wait_bound(), metadata=self.config.metadata()
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return UpdateOperation.from_proto(response)

    async def update_weights_from_ipc(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        etag: str | None = None,
        request_id: str | None = None,
        pause_mode: str = "keep",
        reset_prefix_cache: bool = True,
        timeout: float | None = None,
        progress: bool = False,
    ) -> UpdateResult:
        """Load CPU or CUDA `tensors` (as update_weights_from_tensors) by reference, for a
        server on this host: UpdateWeightsFromIpc (trainer_ipc.py). CPU tensors move into
        shared memory on first use (once, in place). Waits for the update, since the engine
        reads the tensors until it ends: keep them alive and unchanged until this returns."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        return await update_from_ipc(self, tensors, options, progress)

    # --- broadcast groups --------------------------------------------------------------

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
        workers join as ranks rank_offset.. . Returns once every member joined."""
        if world_size is None:
            world_size = rank_offset + (await self.get_server_info()).num_workers
        group = await asyncio.to_thread(
            BroadcastGroup.host, group_name, backend, master_address, master_port, world_size, timeout
        )
        request = pb2.InitWeightsUpdateGroupRequest(
            group_name=group_name,
            master_address=master_address,
            master_port=group.port,
            rank_offset=rank_offset,
            world_size=world_size,
            backend=BACKENDS[backend],
            timeout=duration(timeout),
        )
        joining = asyncio.ensure_future(asyncio.to_thread(group.join))
        calling = asyncio.ensure_future(self._unary(self._updates.InitWeightsUpdateGroup, request, timeout + GRACE_S))
        await asyncio.wait({joining, calling}, return_when=asyncio.FIRST_EXCEPTION)
        if calling.done() and calling.exception() is not None or joining.done() and joining.exception() is not None:
            # The server's answer says best what went wrong; a join left blocked ends at its timeout.
            joining.add_done_callback(lambda f: f.exception())
            group.close()
            await calling  # raises the server's error if it has one
            await joining
        response = await calling
        await joining
        self._groups[group_name] = group
        g = response.group
        return WeightsUpdateGroup(
            g.group_name, backend, g.master_address, g.master_port, g.world_size, g.rank_offset, g.num_engine_ranks
        )

    async def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, *, allow_missing: bool = False, timeout: float | None = None
    ) -> bool:
        """Destroy the group on the server and locally; False when the server had none
        (with `allow_missing`)."""
        self._forget_group(group_name, "destroyed")
        response = await self._unary(
            self._updates.DestroyWeightsUpdateGroup,
            pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name, allow_missing=allow_missing),
            timeout,
        )
        return bool(response.found)

    def _forget_group(self, name: str, why: str) -> None:
        group = self._groups.pop(name, None)
        if group is not None:
            group.broken = group.broken or why
            group.close()

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
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no local group {group_name!r}: call init_weights_update_group first")
        named = named_tensors(tensors, group.device)
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout, stage_only)
        request = options.fill(
            pb2.UpdateWeightsFromDistributedRequest(
                group_name=group_name, tensors=[tensor_spec(n, t) for n, t in named], bucket_bytes=bucket_bytes
            )
        )
        op = UpdateOperation.from_proto(await self._unary(self._updates.UpdateWeightsFromDistributed, request, None))
        return AsyncBroadcast(self, group, op, [t for _, t in named], options, progress, bucket_bytes)

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
        broadcast = await self.start_broadcast(
            tensors,
            version,
            group_name=group_name,
            etag=etag,
            request_id=request_id,
            pause_mode=pause_mode,
            reset_prefix_cache=reset_prefix_cache,
            timeout=timeout,
            progress=progress,
            bucket_bytes=bucket_bytes,
        )
        await broadcast.send()
        return await broadcast.wait()


class TrainerClient(Client):
    """Blocking trainer client with the methods of AsyncTrainerClient; a context manager."""

    _core: AsyncTrainerClient

    async def _connect(self, target: str, config: ChannelOptions) -> AsyncTrainerClient:
        return AsyncTrainerClient(target, **config)

    get_server_info = blocking(AsyncTrainerClient.get_server_info)
    generation_state = blocking(AsyncTrainerClient.generation_state)
    pause_generation = blocking(AsyncTrainerClient.pause_generation)
    resume_generation = blocking(AsyncTrainerClient.resume_generation)
    paused = entering(AsyncTrainerClient.paused)
    verify_weights = blocking(AsyncTrainerClient.verify_weights)
    get_operation = blocking(AsyncTrainerClient.get_operation)
    list_operations = blocking(AsyncTrainerClient.list_operations)
    wait_operation = blocking(AsyncTrainerClient.wait_operation)
    cancel_operation = blocking(AsyncTrainerClient.cancel_operation)
    update_weights_from_disk = blocking(AsyncTrainerClient.update_weights_from_disk)
    update_weights_from_tensors = blocking(AsyncTrainerClient.update_weights_from_tensors)
    update_weights_from_ipc = blocking(AsyncTrainerClient.update_weights_from_ipc)
    init_weights_update_group = blocking(AsyncTrainerClient.init_weights_update_group)
    destroy_weights_update_group = blocking(AsyncTrainerClient.destroy_weights_update_group)
    start_broadcast = blocking(AsyncTrainerClient.start_broadcast, Broadcast)
    broadcast_weights = blocking(AsyncTrainerClient.broadcast_weights)
    stage_weights_from_disk = blocking(AsyncTrainerClient.stage_weights_from_disk)
    start_stage_from_disk = blocking(AsyncTrainerClient.start_stage_from_disk)
    stage_weights_from_tensors = blocking(AsyncTrainerClient.stage_weights_from_tensors)
    stage_broadcast_weights = blocking(AsyncTrainerClient.stage_broadcast_weights)
    commit_staged_weights = blocking(AsyncTrainerClient.commit_staged_weights)
    discard_staged_weights = blocking(AsyncTrainerClient.discard_staged_weights)
