"""WeightUpdateService servicer: proto <-> WeightUpdates.

Runs in the `enginectl serve` process, on the control loop. Thin on purpose: the rules live
in updates.py and its neighbours; errors raised as ControlPlaneError become google.rpc.Status in the
interceptor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.longrunning import operations_pb2

from enginectl.contract.engine import Cause
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.interceptors import caller_authenticated
from enginectl.server.limits import MAX_CHUNK_BYTES
from enginectl.server.weights.channels import UpdateChannels
from enginectl.server.weights.operations import UpdateOperation
from enginectl.server.weights.updates import WeightUpdates
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


class WeightUpdateServicer(pb2_grpc.WeightUpdateServiceServicer):
    """Pause/resume, the four updates and commits (returning Operations), discards, groups,
    GetServerInfo."""

    def __init__(self, info: pb2.GetServerInfoResponse, updates: WeightUpdates | None = None) -> None:
        self._info = info
        # Where this server reads weights from is for the token's holder only (the proto's
        # allowed_weight_roots): callers without it get the same answer minus that list.
        self._public_info = pb2.GetServerInfoResponse()
        self._public_info.CopyFrom(info)
        del self._public_info.allowed_weight_roots[:]
        self._updates = updates

    @property
    def updates(self) -> WeightUpdates:
        if self._updates is None:
            raise ControlPlaneError(grpc.StatusCode.UNIMPLEMENTED, Reason.NOT_IMPLEMENTED, "this server has no engine")
        return self._updates

    async def GetServerInfo(
        self, request: pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetServerInfoResponse:
        if self._info.auth_required and not caller_authenticated.get():
            return self._public_info
        return self._info

    async def PauseGeneration(
        self, request: pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb2.PauseGenerationResponse:
        return await self.updates.pause(request)

    async def ResumeGeneration(
        self, request: pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb2.ResumeGenerationResponse:
        return await self.updates.resume(request)

    async def GetGenerationState(
        self, request: pb2.GetGenerationStateRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetGenerationStateResponse:
        return pb2.GetGenerationStateResponse(state=await self.updates.generation_state())

    async def UpdateWeightsFromDisk(
        self, request: pb2.UpdateWeightsFromDiskRequest, context: grpc.aio.ServicerContext
    ) -> operations_pb2.Operation:
        updates = self.updates
        op, _ = await updates.start(await asyncio.to_thread(updates.plan_disk, request))
        return op.proto()

    async def InitWeightsUpdateGroup(
        self, request: pb2.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb2.InitWeightsUpdateGroupResponse:
        return pb2.InitWeightsUpdateGroupResponse(group=await self.updates.init_group(request))

    async def DestroyWeightsUpdateGroup(
        self, request: pb2.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb2.DestroyWeightsUpdateGroupResponse:
        return pb2.DestroyWeightsUpdateGroupResponse(found=await self.updates.destroy_group(request))

    async def UpdateWeightsFromDistributed(
        self, request: pb2.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> operations_pb2.Operation:
        updates = self.updates
        op, _ = await updates.start(updates.plan_distributed(request))
        return op.proto()

    async def UpdateWeightsFromIpc(
        self, request: pb2.UpdateWeightsFromIpcRequest, context: grpc.aio.ServicerContext
    ) -> operations_pb2.Operation:
        updates = self.updates
        op, _ = await updates.start(updates.plans.ipc(request, self._info.num_workers))
        return op.proto()

    async def CommitStagedWeights(
        self, request: pb2.CommitStagedWeightsRequest, context: grpc.aio.ServicerContext
    ) -> operations_pb2.Operation:
        updates = self.updates
        retried = updates.retried_commit(request)
        if retried is not None:
            return retried.proto()
        op, _ = await updates.start(updates.plan_commit(request))
        return op.proto()

    async def DiscardStagedWeights(
        self, request: pb2.DiscardStagedWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb2.DiscardStagedWeightsResponse:
        return await self.updates.discard(request)

    async def UpdateWeightsFromTensors(
        self, request_iterator: AsyncIterator[pb2.UpdateWeightsFromTensorsRequest], context: grpc.aio.ServicerContext
    ) -> operations_pb2.Operation:
        updates = self.updates
        messages = request_iterator.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("payload") != "header":
            raise ControlPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                Reason.HEADER_REQUIRED,
                "the first message must be a header (tensor specs, version, options)",
            )
        plan = updates.plan_tensors(first.header)
        total = plan.bytes_total
        fed = asyncio.Event()
        broken = asyncio.Event()  # the call was cancelled: the client went away
        fed_channels: list[UpdateChannels] = []

        async def feed(channels: UpdateChannels, op: UpdateOperation) -> None:
            fed_channels.append(channels)
            received = 0
            try:
                async for message in messages:
                    if channels.aborted is not None:
                        break
                    if message.WhichOneof("payload") != "chunk":
                        channels.abort(
                            Cause.HEADER_REQUIRED, "a second header: every message after the first is a chunk"
                        )
                        break
                    data, offset = message.chunk.data, message.chunk.offset
                    if not data or len(data) > MAX_CHUNK_BYTES:
                        channels.abort(
                            Cause.CHUNK_TOO_LARGE, f"a chunk holds 1..{MAX_CHUNK_BYTES} bytes; got {len(data)}"
                        )
                        break
                    if offset != received:
                        channels.abort(Cause.CHUNK_OUT_OF_ORDER, f"chunk offset {offset}, expected {received}")
                        break
                    if received + len(data) > total:
                        channels.abort(
                            Cause.DATA_SIZE_MISMATCH,
                            f"{received + len(data)} bytes sent; the header's tensors hold {total}",
                        )
                        break
                    await channels.send_chunk(offset, data)
                    received += len(data)
                else:
                    if received < total and not await _broke(broken):
                        channels.abort(
                            Cause.DATA_SIZE_MISMATCH, f"the client half-closed after {received} of {total} bytes"
                        )
                    elif received < total:
                        channels.abort(Cause.STREAM_BROKEN, f"the client went away after {received} of {total} bytes")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the call broke under us
                channels.abort(Cause.STREAM_BROKEN, f"the stream broke: {type(exc).__name__}")
            finally:
                fed.set()

        op, started = await updates.start(plan, feed)
        store = updates.operations
        if started:
            try:
                waiters = {
                    asyncio.ensure_future(fed.wait()),
                    asyncio.ensure_future(op.finished.wait()),
                    asyncio.ensure_future(store.closing.wait()),
                }
                _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for waiter in pending:
                    waiter.cancel()
                if not op.done and fed_channels and fed_channels[0].aborted is not None:
                    await store.wait(op, None)  # the update is failing: the call ends with its error
            except asyncio.CancelledError:
                broken.set()
                updates.abort(op, Cause.STREAM_BROKEN, "the client cancelled the stream or went away")
                raise
        if op.done and op.failure is not None:
            raise op.failure
        if not op.done and store.closing.is_set():
            raise store.closed_error()
        return op.proto()


# A broken connection ends the request stream much as a half-close does; grpc.aio tells them
# apart only by cancelling the handler, which can land just after the stream's end.
STREAM_END_GRACE_S = 0.25


async def _broke(broken: asyncio.Event) -> bool:
    """After the request stream ended short: was it the connection breaking (the handler is
    cancelled within STREAM_END_GRACE_S) rather than the client half-closing?"""
    try:
        await asyncio.wait_for(broken.wait(), STREAM_END_GRACE_S)
    except asyncio.TimeoutError:
        return False
    return True
