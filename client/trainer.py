"""Trainer client: load new weights into a serving engine and know which version it serves.

Runs in the trainer process. `AsyncTrainerClient` (asyncio) extends `AsyncClient` with
WeightUpdateService, VerifyWeights and google.longrunning.Operations; `TrainerClient` offers
the same methods blocking (it drives an AsyncTrainerClient on a private event-loop thread).

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
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import IO, Any, Self, TypeVar

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import duration_pb2

from enginectl.client.client import DEFAULT_TARGET, AsyncClient
from enginectl.client.errors import DeadlineExceededError, from_rpc_error
from enginectl.client.trainer_tensors import (
    BACKENDS,
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
    UpdateProgress,
    UpdateResult,
    Verification,
)
from enginectl.client.types import WeightVersion
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2


T = TypeVar("T")

PAUSE_MODES = {"abort": pb2.PAUSE_MODE_ABORT, "wait": pb2.PAUSE_MODE_WAIT, "keep": pb2.PAUSE_MODE_KEEP}
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
DEFAULT_GROUP = "enginectl-trainer"
POLL_S = 0.2  # WaitOperation slice while drawing progress
WAIT_SLICE_S = 60.0  # WaitOperation slice otherwise
GRACE_S = 60.0  # beyond an update's own timeout, for the server to report its end


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _pause_mode(mode: str) -> int:
    try:
        return PAUSE_MODES[mode.lower()]
    except KeyError:
        raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, not {mode!r}") from None


@dataclass(frozen=True)
class UpdateOptions:
    """Options every update takes (see UpdateWeightsFromDiskRequest)."""

    version: str | None = None
    etag: str | None = None
    request_id: str | None = None
    pause_mode: str = "keep"
    reset_prefix_cache: bool = True
    timeout: float | None = None

    def fill(self, msg: Any) -> Any:
        """Set the shared fields on a request or stream header; returns it."""
        if self.version is not None:
            msg.weight_version = self.version
        msg.etag = self.etag or ""
        msg.request_id = self.request_id or str(uuid.uuid4())
        msg.pause_mode = _pause_mode(self.pause_mode)
        msg.reset_prefix_cache = self.reset_prefix_cache
        if self.timeout is not None:
            msg.timeout.CopyFrom(_duration(self.timeout))
        return msg

    def wait_bound(self) -> float | None:
        return None if self.timeout is None else self.timeout + GRACE_S


@dataclass(frozen=True)
class WeightsUpdateGroup:
    """A group made by init_weights_update_group; the trainer is rank 0."""

    group_name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    num_engine_ranks: int


class ProgressBar:
    """Draws an update's progress (bytes done of total, phase) on `stream` (stderr): tqdm
    when it is installed, else a plain text bar."""

    WIDTH = 30

    def __init__(self, stream: IO[str] | None = None, *, use_tqdm: bool = True) -> None:
        self.stream = stream or sys.stderr
        self._tqdm: Any = None
        self._last = ""
        self._tqdm_mod: Any = None
        if use_tqdm:
            try:
                import tqdm

                self._tqdm_mod = tqdm
            except ImportError:
                pass

    def update(self, progress: UpdateProgress) -> None:
        total = max(progress.bytes_total, 1)
        if self._tqdm_mod is not None:
            if self._tqdm is None:
                self._tqdm = self._tqdm_mod.tqdm(total=total, unit="B", unit_scale=True, file=self.stream,
                                                 desc="weights")
            self._tqdm.set_postfix_str(f"{progress.phase} {progress.tensors_done}/{progress.tensors_total} tensors")
            self._tqdm.update(progress.bytes_done - self._tqdm.n)
            return
        filled = int(self.WIDTH * min(progress.bytes_done, total) / total)
        line = (f"\rweights [{'#' * filled}{'.' * (self.WIDTH - filled)}] {100 * progress.bytes_done / total:5.1f}% "
                f"{progress.tensors_done}/{progress.tensors_total} tensors "
                f"{progress.bytes_done / 1e6:.1f}/{progress.bytes_total / 1e6:.1f} MB {progress.phase:<14}")
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._last:
            self.stream.write("\n")
            self.stream.flush()


class AsyncBroadcast:
    """An UpdateWeightsFromDistributed in flight: the trainer broadcasts `tensors` in order
    through its group (`send`), then waits for the Operation (`wait`)."""

    def __init__(self, client: AsyncTrainerClient, group: BroadcastGroup, operation: UpdateOperation,
                 tensors: list[Any], options: UpdateOptions, progress: bool) -> None:
        self.client, self.group, self.operation = client, group, operation
        self.options, self.progress = options, progress
        self._tensors = tensors
        self.sent = 0
        self._stop = threading.Event()

    @property
    def name(self) -> str:
        return self.operation.name

    @property
    def remaining(self) -> int:
        return len(self._tensors) - self.sent

    async def send(self, count: int | None = None) -> int:
        """Broadcast the next `count` tensors (all remaining by default); returns how many.
        If the Operation ends first (cancelled, timed out), raises its error."""
        batch = self._tensors[self.sent:self.sent + (self.remaining if count is None else count)]
        sending = asyncio.ensure_future(asyncio.to_thread(self.group.broadcast, batch, self._stop))
        ended = asyncio.ensure_future(self.client._await_done(self.name, None, None))
        try:
            await asyncio.wait({sending, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if not sending.done():
            # The server gave up on the broadcast: this group's collectives can not be trusted.
            self._stop.set()
            self.client._forget_group(self.group.name, "the update ended while broadcasting")
            sending.add_done_callback(lambda f: f.exception())
            op = ended.result()
            if op.error is not None:
                raise op.error
            raise RuntimeError(f"{self.name} ended while tensors were still being broadcast")
        try:
            self.sent += sending.result()
        except Exception:
            self.client._forget_group(self.group.name, self.group.broken)
            # The peers went away because the server ended the update (cancel, timeout, a
            # failed load): its error says why, better than gloo's "connection closed".
            op = await self.client._await_done(self.name, 30.0, None)
            if op.done and op.error is not None:
                raise op.error from None
            raise
        return len(batch)

    async def wait(self, timeout: float | None = None) -> UpdateResult:
        """Wait for the Operation; its result, or its error raised."""
        bound = timeout if timeout is not None else self.options.wait_bound()
        return (await self.client._await_operation(self.name, bound, self.progress)).result()


class AsyncTrainerClient(AsyncClient):
    """asyncio trainer client: `async with AsyncTrainerClient("host:port") as t: ...`."""

    def __init__(self, target: str = DEFAULT_TARGET, **config: Any) -> None:
        super().__init__(target, **config)
        self._updates = pb2_grpc.WeightUpdateServiceStub(self._channel)
        self._operations = operations_pb2_grpc.OperationsStub(self._channel)
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
            await self._unary(self._updates.GetServerInfo, pb2.GetServerInfoRequest(), timeout))
        return self._info

    async def generation_state(self, *, timeout: float | None = None) -> GenerationState:
        """Whether generation is paused, why, and the request counts per rank."""
        response = await self._unary(self._updates.GetGenerationState, pb2.GetGenerationStateRequest(), timeout)
        return GenerationState.from_proto(response.state)

    async def pause_generation(self, mode: str = "keep", *, clear_cache: bool = False,
                               wait_timeout: float | None = None, timeout: float | None = None) -> PauseResult:
        """Pause generation on every rank ("keep" freezes requests, "abort" ends them,
        "wait" drains them within `wait_timeout`). It stays paused across updates."""
        request = pb2.PauseGenerationRequest(mode=_pause_mode(mode), clear_cache=clear_cache)
        if wait_timeout is not None:
            request.wait_timeout.CopyFrom(_duration(wait_timeout))
        if timeout is None and wait_timeout is not None:
            timeout = wait_timeout + self.config.timeout
        return PauseResult.from_proto(await self._unary(self._updates.PauseGeneration, request, timeout))

    async def resume_generation(self, force: bool = False, *, timeout: float | None = None) -> GenerationState:
        """Resume generation; `force` also after a partial update (mixed weights)."""
        response = await self._unary(self._updates.ResumeGeneration, pb2.ResumeGenerationRequest(force=force),
                                     timeout)
        return GenerationState.from_proto(response.state)

    @contextlib.asynccontextmanager
    async def paused(self, mode: str = "keep", *, clear_cache: bool = False,
                     wait_timeout: float | None = None) -> AsyncIterator[PauseResult]:
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

    # --- operations --------------------------------------------------------------------

    async def get_operation(self, name: str, *, timeout: float | None = None) -> UpdateOperation:
        """An update Operation as it is now."""
        op = await self._unary(self._operations.GetOperation, operations_pb2.GetOperationRequest(name=name), timeout)
        return UpdateOperation.from_proto(op)

    async def wait_operation(self, name: str, timeout: float | None = None, *,
                             progress: bool = False) -> UpdateOperation:
        """Wait until the Operation is done or `timeout` (None: no bound) elapsed; returns it
        as it then is (check `done`; `result()` raises its error)."""
        return await self._await_operation(name, timeout, progress, raise_on_deadline=False)

    async def cancel_operation(self, name: str, *, timeout: float | None = None) -> None:
        """Ask the server to stop the update (its error becomes UPDATE_CANCELLED)."""
        await self._unary(self._operations.CancelOperation, operations_pb2.CancelOperationRequest(name=name), timeout)

    async def _wait_slice(self, name: str, seconds: float) -> UpdateOperation:
        request = operations_pb2.WaitOperationRequest(name=name, timeout=_duration(max(seconds, 0.001)))
        op = await self._unary(self._operations.WaitOperation, request, seconds + self.config.timeout)
        return UpdateOperation.from_proto(op)

    async def _await_done(self, name: str, timeout: float | None, bar: ProgressBar | None) -> UpdateOperation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_s = POLL_S if bar is not None else WAIT_SLICE_S
            if deadline is not None:
                slice_s = min(slice_s, deadline - time.monotonic())
            op = await self._wait_slice(name, slice_s)
            if bar is not None:
                bar.update(op.progress)
            if op.done or (deadline is not None and time.monotonic() >= deadline):
                return op

    async def _await_operation(self, name: str, timeout: float | None, progress: bool, *,
                               raise_on_deadline: bool = True) -> UpdateOperation:
        bar = ProgressBar() if progress else None
        try:
            op = await self._await_done(name, timeout, bar)
        finally:
            if bar is not None:
                bar.close()
        if not op.done and raise_on_deadline:
            raise DeadlineExceededError(code=grpc.StatusCode.DEADLINE_EXCEEDED,
                                        message=f"{name} still running after {timeout:.1f}s (phase "
                                                f"{op.progress.phase}); wait_operation or cancel_operation it")
        return op

    async def _finish(self, op: UpdateOperation, options: UpdateOptions, progress: bool,
                      wait: bool) -> UpdateResult | UpdateOperation:
        if not wait:
            return op
        return (await self._await_operation(op.name, options.wait_bound(), progress)).result()

    # --- updates -----------------------------------------------------------------------

    async def update_weights_from_disk(
        self, path: str, version: str | None = None, *, etag: str | None = None, request_id: str | None = None,
        pause_mode: str = "keep", reset_prefix_cache: bool = True, timeout: float | None = None,
        progress: bool = False, wait: bool = True,
    ) -> Any:
        """Load safetensors at `path` (on the server, under an allowed root) and declare
        `version` on success (None: the version becomes undeclared). Returns the
        UpdateResult (`wait=False`: the running UpdateOperation); raises the update's error
        as an EnginectlError. `progress=True` draws a progress bar on stderr."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        request = options.fill(pb2.UpdateWeightsFromDiskRequest(path=str(path)))
        op = UpdateOperation.from_proto(await self._unary(self._updates.UpdateWeightsFromDisk, request, None))
        return await self._finish(op, options, progress, wait)

    async def update_weights_from_tensors(
        self, tensors: TensorSource, version: str | None = None, *, etag: str | None = None,
        request_id: str | None = None, pause_mode: str = "keep", reset_prefix_cache: bool = True,
        timeout: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = False,
        wait: bool = True,
    ) -> Any:
        """Send `tensors` (an nn.Module, a state dict or (name, tensor) pairs; checkpoint
        names) over the UpdateWeightsFromTensors stream: a header, then the raw bytes in
        chunks of `chunk_bytes` (1..4 MiB). Returns as update_weights_from_disk."""
        if not 0 < chunk_bytes <= 4 * 1024 * 1024:
            raise ValueError("chunk_bytes must be in 1..4 MiB")
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        named = named_tensors(tensors)
        header = options.fill(pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named]))

        def messages() -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
            yield pb2.UpdateWeightsFromTensorsRequest(header=header)
            yield from chunks(named, chunk_bytes)

        try:
            response = await self._updates.UpdateWeightsFromTensors(
                messages(), timeout=options.wait_bound(), metadata=self.config.metadata())
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return await self._finish(UpdateOperation.from_proto(response), options, progress, wait)

    # --- broadcast groups --------------------------------------------------------------

    async def init_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, master_address: str = "127.0.0.1", master_port: int = 0, *,
        backend: str = "gloo", rank_offset: int = 1, world_size: int | None = None, timeout: float = 60.0,
    ) -> WeightsUpdateGroup:
        """Create the private group `group_name` with the server: this process is rank 0 and
        hosts its TCPStore at master_address:master_port (0: a free port); the engine's
        workers join as ranks rank_offset.. . Returns once every member joined."""
        if world_size is None:
            world_size = rank_offset + (await self.get_server_info()).num_workers
        group = await asyncio.to_thread(BroadcastGroup.host, group_name, backend, master_address, master_port,
                                        world_size, timeout)
        request = pb2.InitWeightsUpdateGroupRequest(
            group_name=group_name, master_address=master_address, master_port=group.port,
            rank_offset=rank_offset, world_size=world_size, backend=BACKENDS[backend], timeout=_duration(timeout),
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
        return WeightsUpdateGroup(g.group_name, backend, g.master_address, g.master_port, g.world_size,
                                  g.rank_offset, g.num_engine_ranks)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP, *, allow_missing: bool = False,
                                           timeout: float | None = None) -> bool:
        """Destroy the group on the server and locally; False when the server had none
        (with `allow_missing`)."""
        self._forget_group(group_name, "destroyed")
        response = await self._unary(
            self._updates.DestroyWeightsUpdateGroup,
            pb2.DestroyWeightsUpdateGroupRequest(group_name=group_name, allow_missing=allow_missing), timeout)
        return bool(response.found)

    def _forget_group(self, name: str, why: str) -> None:
        group = self._groups.pop(name, None)
        if group is not None:
            group.broken = group.broken or why
            group.close()

    async def start_broadcast(
        self, tensors: TensorSource, version: str | None = None, *, group_name: str = DEFAULT_GROUP,
        etag: str | None = None, request_id: str | None = None, pause_mode: str = "keep",
        reset_prefix_cache: bool = True, timeout: float | None = None, progress: bool = False,
    ) -> AsyncBroadcast:
        """Start UpdateWeightsFromDistributed for `tensors` (in their order); broadcast them
        with `send()` and wait with `wait()`. broadcast_weights does all three."""
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no local group {group_name!r}: call init_weights_update_group first")
        named = named_tensors(tensors, group.device)
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        request = options.fill(pb2.UpdateWeightsFromDistributedRequest(
            group_name=group_name, tensors=[tensor_spec(n, t) for n, t in named]))
        op = UpdateOperation.from_proto(await self._unary(self._updates.UpdateWeightsFromDistributed, request, None))
        return AsyncBroadcast(self, group, op, [t for _, t in named], options, progress)

    async def broadcast_weights(
        self, tensors: TensorSource, version: str | None = None, *, group_name: str = DEFAULT_GROUP,
        etag: str | None = None, request_id: str | None = None, pause_mode: str = "keep",
        reset_prefix_cache: bool = True, timeout: float | None = None, progress: bool = False,
    ) -> UpdateResult:
        """Broadcast `tensors` (nn.Module, state dict or pairs; checkpoint names) through the
        group and declare `version` on success; returns the UpdateResult or raises."""
        broadcast = await self.start_broadcast(
            tensors, version, group_name=group_name, etag=etag, request_id=request_id, pause_mode=pause_mode,
            reset_prefix_cache=reset_prefix_cache, timeout=timeout, progress=progress)
        await broadcast.send()
        return await broadcast.wait()


class _LoopThread:
    """A private event loop on a daemon thread, for the blocking client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="enginectl-trainer", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Broadcast:
    """Blocking view of AsyncBroadcast."""

    def __init__(self, runner: _LoopThread, inner: AsyncBroadcast) -> None:
        self._run, self._inner = runner.run, inner

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def remaining(self) -> int:
        return self._inner.remaining

    def send(self, count: int | None = None) -> int:
        """See AsyncBroadcast.send."""
        return self._run(self._inner.send(count))

    def wait(self, timeout: float | None = None) -> UpdateResult:
        """See AsyncBroadcast.wait."""
        return self._run(self._inner.wait(timeout))


class TrainerClient:
    """Blocking trainer client with the methods of AsyncTrainerClient; a context manager."""

    def __init__(self, target: str = DEFAULT_TARGET, **config: Any) -> None:
        self._loop = _LoopThread()

        async def make() -> AsyncTrainerClient:
            return AsyncTrainerClient(target, **config)

        self._client = self._loop.run(make())
        self.config = self._client.config

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.run(self._client.close())
        self._loop.close()

    def get_weight_version(self, *, timeout: float | None = None) -> WeightVersion:
        """See AsyncClient.get_weight_version."""
        return self._loop.run(self._client.get_weight_version(timeout=timeout))

    def set_weight_version(self, version: str, **kwargs: Any) -> WeightVersion:
        """See AsyncClient.set_weight_version."""
        return self._loop.run(self._client.set_weight_version(version, **kwargs))

    def get_server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """See AsyncTrainerClient.get_server_info."""
        return self._loop.run(self._client.get_server_info(timeout=timeout))

    def generation_state(self, *, timeout: float | None = None) -> GenerationState:
        """See AsyncTrainerClient.generation_state."""
        return self._loop.run(self._client.generation_state(timeout=timeout))

    def pause_generation(self, mode: str = "keep", **kwargs: Any) -> PauseResult:
        """See AsyncTrainerClient.pause_generation."""
        return self._loop.run(self._client.pause_generation(mode, **kwargs))

    def resume_generation(self, force: bool = False, *, timeout: float | None = None) -> GenerationState:
        """See AsyncTrainerClient.resume_generation."""
        return self._loop.run(self._client.resume_generation(force, timeout=timeout))

    @contextlib.contextmanager
    def paused(self, mode: str = "keep", *, clear_cache: bool = False,
               wait_timeout: float | None = None) -> Iterator[PauseResult]:
        """See AsyncTrainerClient.paused."""
        result = self.pause_generation(mode, clear_cache=clear_cache, wait_timeout=wait_timeout)
        try:
            yield result
        finally:
            self.resume_generation()

    def verify_weights(self, full: bool = False, *, timeout: float | None = None) -> Verification:
        """See AsyncTrainerClient.verify_weights."""
        return self._loop.run(self._client.verify_weights(full, timeout=timeout))

    def get_operation(self, name: str, *, timeout: float | None = None) -> UpdateOperation:
        """See AsyncTrainerClient.get_operation."""
        return self._loop.run(self._client.get_operation(name, timeout=timeout))

    def wait_operation(self, name: str, timeout: float | None = None, *, progress: bool = False) -> UpdateOperation:
        """See AsyncTrainerClient.wait_operation."""
        return self._loop.run(self._client.wait_operation(name, timeout, progress=progress))

    def cancel_operation(self, name: str, *, timeout: float | None = None) -> None:
        """See AsyncTrainerClient.cancel_operation."""
        self._loop.run(self._client.cancel_operation(name, timeout=timeout))

    def update_weights_from_disk(self, path: str, version: str | None = None, **kwargs: Any) -> Any:
        """See AsyncTrainerClient.update_weights_from_disk."""
        return self._loop.run(self._client.update_weights_from_disk(path, version, **kwargs))

    def update_weights_from_tensors(self, tensors: TensorSource, version: str | None = None, **kwargs: Any) -> Any:
        """See AsyncTrainerClient.update_weights_from_tensors."""
        return self._loop.run(self._client.update_weights_from_tensors(tensors, version, **kwargs))

    def init_weights_update_group(self, group_name: str = DEFAULT_GROUP, master_address: str = "127.0.0.1",
                                  master_port: int = 0, **kwargs: Any) -> WeightsUpdateGroup:
        """See AsyncTrainerClient.init_weights_update_group."""
        return self._loop.run(self._client.init_weights_update_group(group_name, master_address, master_port,
                                                                     **kwargs))

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP, **kwargs: Any) -> bool:
        """See AsyncTrainerClient.destroy_weights_update_group."""
        return self._loop.run(self._client.destroy_weights_update_group(group_name, **kwargs))

    def start_broadcast(self, tensors: TensorSource, version: str | None = None, **kwargs: Any) -> Broadcast:
        """See AsyncTrainerClient.start_broadcast."""
        return Broadcast(self._loop, self._loop.run(self._client.start_broadcast(tensors, version, **kwargs)))

    def broadcast_weights(self, tensors: TensorSource, version: str | None = None, **kwargs: Any) -> UpdateResult:
        """See AsyncTrainerClient.broadcast_weights."""
        return self._loop.run(self._client.broadcast_weights(tensors, version, **kwargs))
