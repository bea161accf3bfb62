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

AsyncTrainerClient holds one helper per concern, built once in its constructor on the client's
connection and handed the helpers it needs: UpdateOperations (trainer_operations.py),
TensorStream (trainer_tensors.py), BroadcastUpdates (trainer_broadcast.py), IpcUpdates
(trainer_ipc.py), Staging (trainer_staging.py) and TransferRounds (trainer_transfer.py:
vLLM's weight-sync steps, so a trainer client is a `client` of vLLM's trainer-side transfer
engines). A method a helper implements whole is declared once, on the helper, and forwarded
here (`_forwarded`), as TrainerClient's methods are made from AsyncTrainerClient's by
`blocking`. torch is imported only by the calls that
handle tensors (see trainer_tensors.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, Unpack, overload

from enginectl.client._sync import blocking, entering, forwarded
from enginectl.client.client import DEFAULT_TARGET, AsyncClient, ChannelOptions, Client
from enginectl.client.trainer_broadcast import DEFAULT_GROUP, AsyncBroadcast, Broadcast, BroadcastUpdates
from enginectl.client.trainer_ipc import IpcUpdates
from enginectl.client.trainer_operations import UpdateOperations
from enginectl.client.trainer_requests import UpdateOptions, duration, parse_pause_mode
from enginectl.client.trainer_staging import Staging
from enginectl.client.trainer_tensors import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, TensorSource, TensorStream
from enginectl.client.trainer_transfer import TransferRounds
from enginectl.client.trainer_types import (
    GenerationState,
    PauseResult,
    ServerInfo,
    UpdateOperation,
    UpdateResult,
    Verification,
)
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

# Imported from here by callers: client/__init__.py, fleet.py, bench/ (the defaults).
__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_GROUP",
    "AsyncBroadcast",
    "AsyncTrainerClient",
    "Broadcast",
    "TrainerClient",
]

P = ParamSpec("P")
T = TypeVar("T")
H = TypeVar("H")


def _forwarded(
    helper: Callable[[AsyncTrainerClient], H], method: Callable[Concatenate[H, P], Coroutine[Any, Any, T]]
) -> Callable[Concatenate[AsyncTrainerClient, P], Coroutine[Any, Any, T]]:
    """`method` of a helper as a method of AsyncTrainerClient (_sync.py `forwarded`, typed
    for the trainer so that `helper` may be a lambda)."""
    return forwarded(helper, method)


class AsyncTrainerClient(AsyncClient):
    """asyncio trainer client: `async with AsyncTrainerClient("host:port") as t: ...`."""

    def __init__(self, target: str = DEFAULT_TARGET, **config: Unpack[ChannelOptions]) -> None:
        super().__init__(target, **config)
        connection = self.connection
        self._updates = pb2_grpc.WeightUpdateServiceStub(connection.channel)
        self._verify = wv_grpc.WeightVersionServiceStub(connection.channel)
        self._operations = UpdateOperations(connection)
        self._stream = TensorStream(connection, self._updates)
        self._broadcasts: BroadcastUpdates = BroadcastUpdates(self, self._updates)
        self._ipc: IpcUpdates = IpcUpdates(self, self._updates, self._operations)
        self._staging: Staging = Staging(connection, self._updates, self._operations, self._stream, self._broadcasts)
        self._transfers: TransferRounds = TransferRounds(connection, self._updates)

    async def close(self) -> None:
        self._broadcasts.close()
        await super().close()

    # --- server, generation, verification ------------------------------------------

    async def get_server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """Model, parallelism, backends, limits of the server (no engine round trip)."""
        response = await self.connection.unary(self._updates.GetServerInfo, pb2.GetServerInfoRequest(), timeout)
        return ServerInfo.from_proto(response)

    async def generation_state(self, *, timeout: float | None = None) -> GenerationState:
        """Whether generation is paused, why, and the request counts per rank."""
        request = pb2.GetGenerationStateRequest()
        response = await self.connection.unary(self._updates.GetGenerationState, request, timeout)
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
        return PauseResult.from_proto(await self.connection.unary(self._updates.PauseGeneration, request, timeout))

    async def resume_generation(self, force: bool = False, *, timeout: float | None = None) -> GenerationState:
        """Resume generation; `force` also after a partial update (mixed weights)."""
        request = pb2.ResumeGenerationRequest(force=force)
        response = await self.connection.unary(self._updates.ResumeGeneration, request, timeout)
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
        request = wv_pb2.VerifyWeightsRequest(full=full)
        return Verification.from_proto(await self.connection.unary(self._verify.VerifyWeights, request, timeout))

    # --- operations (trainer_operations.py) ---------------------------------------------

    get_operation = _forwarded(lambda t: t._operations, UpdateOperations.get_operation)
    list_operations = _forwarded(lambda t: t._operations, UpdateOperations.list_operations)
    wait_operation = _forwarded(lambda t: t._operations, UpdateOperations.wait_operation)
    cancel_operation = _forwarded(lambda t: t._operations, UpdateOperations.cancel_operation)

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
        started = await self.connection.unary(self._updates.UpdateWeightsFromDisk, request, None)
        return await self._operations.finish(UpdateOperation.from_proto(started), options, progress, wait)

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
        if zero_copy and (result := await self._ipc.zero_copy(tensors, options, progress, wait)) is not None:
            return result
        op = await self._stream.start(tensors, options, chunk_bytes)
        return await self._operations.finish(op, options, progress, wait)

    update_weights_from_ipc = _forwarded(lambda t: t._ipc, IpcUpdates.update_weights_from_ipc)

    # --- broadcast groups (trainer_broadcast.py) ----------------------------------------

    init_weights_update_group = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.init_weights_update_group)
    destroy_weights_update_group = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.destroy_weights_update_group)
    start_broadcast = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.start_broadcast)
    broadcast_weights = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.broadcast_weights)
    # A group this process hosts for many servers (a Fleet's): each server joins, then updates.
    join_update_group = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.join_server)
    start_distributed_update = _forwarded(lambda t: t._broadcasts, BroadcastUpdates.start_distributed)

    # --- two-phase updates (trainer_staging.py) -----------------------------------------

    stage_weights_from_disk = _forwarded(lambda t: t._staging, Staging.stage_weights_from_disk)
    start_stage_from_disk = _forwarded(lambda t: t._staging, Staging.start_stage_from_disk)
    stage_weights_from_tensors = _forwarded(lambda t: t._staging, Staging.stage_weights_from_tensors)
    stage_broadcast_weights = _forwarded(lambda t: t._staging, Staging.stage_broadcast_weights)
    commit_staged_weights = _forwarded(lambda t: t._staging, Staging.commit_staged_weights)
    discard_staged_weights = _forwarded(lambda t: t._staging, Staging.discard_staged_weights)

    # --- vLLM's weight-transfer steps (trainer_transfer.py) -----------------------------

    init_weight_transfer_engine = _forwarded(lambda t: t._transfers, TransferRounds.init_weight_transfer_engine)
    start_weight_update = _forwarded(lambda t: t._transfers, TransferRounds.start_weight_update)
    update_weights = _forwarded(lambda t: t._transfers, TransferRounds.update_weights)
    finish_weight_update = _forwarded(lambda t: t._transfers, TransferRounds.finish_weight_update)
    shutdown_weight_transfer_engine = _forwarded(lambda t: t._transfers, TransferRounds.shutdown_weight_transfer_engine)


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
    init_weight_transfer_engine = blocking(AsyncTrainerClient.init_weight_transfer_engine)
    start_weight_update = blocking(AsyncTrainerClient.start_weight_update)
    update_weights = blocking(AsyncTrainerClient.update_weights)
    finish_weight_update = blocking(AsyncTrainerClient.finish_weight_update)
    shutdown_weight_transfer_engine = blocking(AsyncTrainerClient.shutdown_weight_transfer_engine)
