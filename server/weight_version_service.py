"""WeightVersionService servicer: proto <-> WeightVersionLedger.

Runs in the `enginectl serve` process. Thin on purpose: the rules live in the ledger, errors
raised as ControlPlaneError become google.rpc.Status in the interceptor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import timestamp_pb2

from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.ledger import LedgerClosed, VersionState, WeightVersionLedger
from enginectl.weights.v1 import (
    weight_version_pb2 as wv_pb2,
    weight_version_service_pb2 as pb2,
    weight_version_service_pb2_grpc as pb2_grpc,
)


def weight_version_proto(state: VersionState) -> wv_pb2.WeightVersion:
    """The WeightVersion message for a ledger state."""
    msg = wv_pb2.WeightVersion(
        declared=state.declared,
        revision=state.revision,
        incarnation=state.incarnation,
        etag=state.etag,
        source=wv_pb2.WeightSource.Value(f"WEIGHT_SOURCE_{state.source.value}"),
    )
    if state.version is not None:
        msg.version = state.version
    if state.declare_time is not None:
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(int(state.declare_time * 1e9))
        msg.declare_time.CopyFrom(stamp)
    return msg


class WeightVersionServicer(pb2_grpc.WeightVersionServiceServicer):
    """Serves GetWeightVersion, SetWeightVersion and WatchWeightVersion from a ledger."""

    def __init__(self, ledger: WeightVersionLedger) -> None:
        self._ledger = ledger
        # GetWeightVersion is the hot read: build its answer once per state, not per call.
        self._answer: tuple[VersionState | None, pb2.GetWeightVersionResponse] = (
            None, pb2.GetWeightVersionResponse(),
        )

    async def GetWeightVersion(
        self, request: pb2.GetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetWeightVersionResponse:
        state = self._ledger.state
        if self._answer[0] is not state:
            self._answer = (state, pb2.GetWeightVersionResponse(weight_version=weight_version_proto(state)))
        return self._answer[1]

    async def SetWeightVersion(
        self, request: pb2.SetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb2.SetWeightVersionResponse:
        state = await self._ledger.declare(
            request.version, etag=request.etag, request_id=request.request_id
        )
        return pb2.SetWeightVersionResponse(weight_version=weight_version_proto(state))

    async def WatchWeightVersion(
        self, request: pb2.WatchWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb2.WatchWeightVersionResponse]:
        since = request.since_revision if request.HasField("since_revision") else None
        try:
            async for state in self._ledger.watch(since):
                yield pb2.WatchWeightVersionResponse(weight_version=weight_version_proto(state))
        except LedgerClosed:
            raise ControlPlaneError(
                grpc.StatusCode.UNAVAILABLE, Reason.SHUTTING_DOWN, "server is shutting down"
            ) from None
