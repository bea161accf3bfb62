"""WeightVersionService servicer: each RPC is one call into the ledger (or, VerifyWeights,
into WeightUpdates), its answer written by convert.py.

Runs in the `enginectl serve` process, on the control loop, in each RPC's handler. Thin on
purpose: the rules live in the ledger (weights/version/ledger.py); errors raised as ControlPlaneError
become google.rpc.Status in the interceptor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from enginectl.server.errors import ControlPlaneError
from enginectl.server.servicer_context import ServicerContext
from enginectl.server.weights.convert import weight_version_proto
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import LedgerClosed, VersionState, WeightVersionLedger
from enginectl.weights.v1 import weight_version_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as pb2_grpc


class WeightVersionServicer(pb2_grpc.WeightVersionServiceServicer):
    """Serves GetWeightVersion, SetWeightVersion and WatchWeightVersion from a ledger."""

    def __init__(self, ledger: WeightVersionLedger, updates: WeightUpdates | None = None) -> None:
        self._ledger = ledger
        self._updates = updates
        # GetWeightVersion is the hot read: build its answer once per state, not per call.
        self._answer: tuple[VersionState | None, pb2.GetWeightVersionResponse] = (
            None,
            pb2.GetWeightVersionResponse(),
        )

    async def GetWeightVersion(
        self, request: pb2.GetWeightVersionRequest, context: ServicerContext
    ) -> pb2.GetWeightVersionResponse:
        state = self._ledger.state
        if self._answer[0] is not state:
            self._answer = (state, pb2.GetWeightVersionResponse(weight_version=weight_version_proto(state)))
        return self._answer[1]

    async def SetWeightVersion(
        self, request: pb2.SetWeightVersionRequest, context: ServicerContext
    ) -> pb2.SetWeightVersionResponse:
        state = await self._ledger.declare(request.version, etag=request.etag, request_id=request.request_id)
        return pb2.SetWeightVersionResponse(weight_version=weight_version_proto(state))

    async def WatchWeightVersion(
        self, request: pb2.WatchWeightVersionRequest, context: ServicerContext
    ) -> AsyncIterator[pb2.WatchWeightVersionResponse]:
        since = request.since_revision if request.HasField("since_revision") else None
        try:
            async for state in self._ledger.watch(since, request.incarnation):
                yield pb2.WatchWeightVersionResponse(weight_version=weight_version_proto(state))
        except LedgerClosed as closed:  # SHUTTING_DOWN, or ENGINE_DEAD
            raise ControlPlaneError(grpc.StatusCode.UNAVAILABLE, closed.reason, closed.message) from None

    async def VerifyWeights(
        self, request: pb2.VerifyWeightsRequest, context: ServicerContext
    ) -> pb2.VerifyWeightsResponse:
        assert self._updates is not None  # refused without an engine before here (grpc_server.py)
        return await self._updates.verify(request.full)
