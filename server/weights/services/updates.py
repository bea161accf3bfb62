"""WeightUpdateService servicer: each RPC is one call into WeightUpdates (weights/updates.py).

Runs in the `enginectl serve` process, on the control loop, in each RPC's handler. Thin on
purpose: the rules live in the cores of server/weights/ (the tensor stream's feed in
tensor_stream.py); errors raised as ControlPlaneError become google.rpc.Status in the
interceptor. GetServerInfo is answered here, from the info the server built once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from google.longrunning import operations_pb2

from enginectl.server.interceptors import caller_authenticated
from enginectl.server.servicer_context import ServicerContext, caller_of
from enginectl.server.weights.transfer import WeightTransfer
from enginectl.server.weights.updates import WeightUpdates
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


class WeightUpdateServicer(pb2_grpc.WeightUpdateServiceServicer):
    """Pause/resume, the four updates and commits (returning Operations), discards, groups,
    GetServerInfo."""

    def __init__(
        self,
        info: pb2.GetServerInfoResponse,
        updates: WeightUpdates | None = None,
        transfer: WeightTransfer | None = None,
    ) -> None:
        self._info = info
        # Where this server reads weights from is for the token's holder only (the proto's
        # allowed_weight_roots): callers without it get the same answer minus that list.
        self._public_info = pb2.GetServerInfoResponse()
        self._public_info.CopyFrom(info)
        del self._public_info.allowed_weight_roots[:]
        self._updates = updates
        self._transfer = transfer

    @property
    def transfer(self) -> WeightTransfer:
        assert self._transfer is not None  # as `updates`: refused without an engine
        return self._transfer

    @property
    def updates(self) -> WeightUpdates:
        # Without an engine the interceptor refuses every RPC that needs one before it gets
        # here (grpc_server.py, the one place "no engine" is refused).
        assert self._updates is not None
        return self._updates

    async def GetServerInfo(
        self, request: pb2.GetServerInfoRequest, context: ServicerContext
    ) -> pb2.GetServerInfoResponse:
        if self._info.auth_required and not caller_authenticated.get():
            return self._public_info
        return self._info

    async def PauseGeneration(
        self, request: pb2.PauseGenerationRequest, context: ServicerContext
    ) -> pb2.PauseGenerationResponse:
        return await self.updates.pause(request)

    async def ResumeGeneration(
        self, request: pb2.ResumeGenerationRequest, context: ServicerContext
    ) -> pb2.ResumeGenerationResponse:
        return await self.updates.resume(request)

    async def GetGenerationState(
        self, request: pb2.GetGenerationStateRequest, context: ServicerContext
    ) -> pb2.GetGenerationStateResponse:
        return pb2.GetGenerationStateResponse(state=await self.updates.generation_state())

    async def UpdateWeightsFromDisk(
        self, request: pb2.UpdateWeightsFromDiskRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.updates.update_from_disk(request, caller_of(context))).proto()

    async def InitWeightsUpdateGroup(
        self, request: pb2.InitWeightsUpdateGroupRequest, context: ServicerContext
    ) -> pb2.InitWeightsUpdateGroupResponse:
        return pb2.InitWeightsUpdateGroupResponse(group=await self.updates.init_group(request, caller_of(context)))

    async def DestroyWeightsUpdateGroup(
        self, request: pb2.DestroyWeightsUpdateGroupRequest, context: ServicerContext
    ) -> pb2.DestroyWeightsUpdateGroupResponse:
        return pb2.DestroyWeightsUpdateGroupResponse(found=await self.updates.destroy_group(request))

    async def UpdateWeightsFromDistributed(
        self, request: pb2.UpdateWeightsFromDistributedRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.updates.update_from_distributed(request, caller_of(context))).proto()

    async def UpdateWeightsFromIpc(
        self, request: pb2.UpdateWeightsFromIpcRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.updates.update_from_ipc(request, caller_of(context))).proto()

    async def CommitStagedWeights(
        self, request: pb2.CommitStagedWeightsRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.updates.commit(request, caller_of(context))).proto()

    async def DiscardStagedWeights(
        self, request: pb2.DiscardStagedWeightsRequest, context: ServicerContext
    ) -> pb2.DiscardStagedWeightsResponse:
        return await self.updates.discard(request)

    async def UpdateWeightsFromTensors(
        self, request_iterator: AsyncIterator[pb2.UpdateWeightsFromTensorsRequest], context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.updates.update_from_tensors(request_iterator, caller_of(context))).proto()

    # --- vLLM's weight-transfer engines (weights/transfer.py) ---------------------------------

    async def InitWeightTransferEngine(
        self, request: pb2.InitWeightTransferEngineRequest, context: ServicerContext
    ) -> pb2.InitWeightTransferEngineResponse:
        return await self.transfer.init(request, caller_of(context))

    async def StartWeightUpdate(
        self, request: pb2.StartWeightUpdateRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.transfer.start(request, caller_of(context))).proto()

    async def UpdateWeights(
        self, request: pb2.UpdateWeightsRequest, context: ServicerContext
    ) -> pb2.UpdateWeightsBatchResponse:
        return await self.transfer.update(request)

    async def FinishWeightUpdate(
        self, request: pb2.FinishWeightUpdateRequest, context: ServicerContext
    ) -> operations_pb2.Operation:
        return (await self.transfer.finish(request)).proto()

    async def ShutdownWeightTransferEngine(
        self, request: pb2.ShutdownWeightTransferEngineRequest, context: ServicerContext
    ) -> pb2.ShutdownWeightTransferEngineResponse:
        return await self.transfer.shutdown(request)
