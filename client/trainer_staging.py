"""Two-phase updates for the trainer client: stage while the engine generates, commit in
one short pause, or discard (docs/weights.md, "Two-phase updates").

Runs in the trainer process. `Staging` starts and waits for the stages, commits and discards;
AsyncTrainerClient (client/trainer.py) holds one and forwards its stage_* / commit / discard
methods to it; TrainerClient has the same methods blocking.

    with TrainerClient("127.0.0.1:50051") as t:
        staged = t.stage_weights_from_disk("/ckpt/step-42", "step-42")  # generation goes on
        t.commit_staged_weights(staged.name, etag=etag_read_before)     # a short pause
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from enginectl.client.client import Connection
from enginectl.client.trainer_broadcast import DEFAULT_GROUP, BroadcastUpdates
from enginectl.client.trainer_operations import UpdateOperations
from enginectl.client.trainer_requests import UpdateOptions
from enginectl.client.trainer_tensors import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, TensorSource, TensorStream
from enginectl.client.trainer_types import StagedWeights, UpdateOperation, UpdateResult
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


def _stage_options(version: str | None, request_id: str | None, timeout: float | None) -> UpdateOptions:
    """What every stage sends: no etag and no pause (nothing it serves changes), stage_only."""
    return UpdateOptions(version, None, request_id, "keep", True, timeout, stage_only=True)


def _staged(result: UpdateResult) -> StagedWeights:
    if result.staged is None:  # a server that ignored stage_only (older than this client)
        raise RuntimeError(f"{result.operation} loaded the weights instead of staging them: the server is too old")
    return result.staged


class Staging:
    """Two-phase updates on one connection: each stage is started the way its update would be
    (the disk request, the tensor stream, the broadcast), marked stage_only."""

    def __init__(
        self,
        connection: Connection,
        stub: pb2_grpc.WeightUpdateServiceStub,
        operations: UpdateOperations,
        stream: TensorStream,
        broadcasts: BroadcastUpdates,
    ) -> None:
        self._connection, self._stub = connection, stub
        self._operations, self._stream, self._broadcasts = operations, stream, broadcasts

    async def stage_weights_from_disk(
        self,
        path: str,
        version: str | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        progress: bool = False,
    ) -> StagedWeights:
        """Read safetensors at `path` (on the server) into its staging area while it keeps
        generating; nothing it serves changes. `version` is what the commit declares unless
        the commit names one. Returns the staged set (raises the stage's error)."""
        options = _stage_options(version, request_id, timeout)
        return await self._until_staged(await self._start_from_disk(path, options), options, progress)

    async def start_stage_from_disk(
        self, path: str, version: str | None = None, *, request_id: str | None = None, timeout: float | None = None
    ) -> UpdateOperation:
        """stage_weights_from_disk without waiting: the running stage's Operation."""
        return await self._start_from_disk(path, _stage_options(version, request_id, timeout))

    async def stage_weights_from_tensors(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: bool = False,
    ) -> StagedWeights:
        """Stream `tensors` (as update_weights_from_tensors) into the server's staging area
        while it keeps generating. Returns the staged set."""
        options = _stage_options(version, request_id, timeout)
        return await self._until_staged(await self._stream.start(tensors, options, chunk_bytes), options, progress)

    async def stage_broadcast_weights(
        self,
        tensors: TensorSource,
        version: str | None = None,
        *,
        group_name: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        progress: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> StagedWeights:
        """Broadcast `tensors` through the group (init_weights_update_group first) into the
        server's staging area while it keeps generating. Returns the staged set."""
        options = _stage_options(version, request_id, timeout)
        return _staged(
            await self._broadcasts.run(tensors, options, group_name or DEFAULT_GROUP, progress, bucket_bytes)
        )

    async def commit_staged_weights(
        self,
        name: str,
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
        """Apply the staged set `name` under one short pause and declare `version` (None: the
        version the stage named). With `etag`, only while the server still serves the version
        you read (else AbortedError ETAG_MISMATCH, nothing changed, the set kept). Returns
        the UpdateResult (`wait=False`: the running UpdateOperation)."""
        options = UpdateOptions(version, etag, request_id, pause_mode, reset_prefix_cache, timeout)
        request = options.fill(pb2.CommitStagedWeightsRequest(name=name))
        if version is None:
            request.ClearField("weight_version")
        op = UpdateOperation.from_proto(await self._connection.unary(self._stub.CommitStagedWeights, request, None))
        return await self._operations.finish(op, options, progress, wait)

    async def discard_staged_weights(
        self, name: str, *, allow_missing: bool = False, timeout: float | None = None
    ) -> int:
        """Drop the staged set `name` (a stage still receiving is cancelled); the bytes freed
        on the server's workers (0 when it had no such set and `allow_missing`)."""
        request = pb2.DiscardStagedWeightsRequest(name=name, allow_missing=allow_missing)
        response = await self._connection.unary(self._stub.DiscardStagedWeights, request, timeout)
        return int(response.bytes_freed)

    async def _start_from_disk(self, path: str, options: UpdateOptions) -> UpdateOperation:
        request = options.fill(pb2.UpdateWeightsFromDiskRequest(path=str(path)))
        return UpdateOperation.from_proto(await self._connection.unary(self._stub.UpdateWeightsFromDisk, request, None))

    async def _until_staged(self, op: UpdateOperation, options: UpdateOptions, progress: bool) -> StagedWeights:
        """The set the stage `op` staged, once it is done (its error raised)."""
        return _staged((await self._operations.until_done(op.name, options.wait_bound(), progress)).result())
