"""WeightUpdateService servicer. For now only GetServerInfo, the operator's view of a server;
the update RPCs answer UNIMPLEMENTED (see ControlPlaneServer) until they land.

Runs in the `enginectl serve` process, on the control loop.
"""

from __future__ import annotations

import grpc

from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


class WeightUpdateServicer(pb2_grpc.WeightUpdateServiceServicer):
    """Answers GetServerInfo from a response built once at start (nothing in it changes)."""

    def __init__(self, info: pb2.GetServerInfoResponse) -> None:
        self._info = info

    async def GetServerInfo(
        self, request: pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetServerInfoResponse:
        return self._info
