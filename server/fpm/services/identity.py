"""FpmIdentityService servicer: proto <-> IdentitySync.

Runs in the `enginectl serve` process, on the control loop. Thin on purpose: the rules live
in server/fpm/identity.py; errors raised as ControlPlaneError become google.rpc.Status in the
interceptor (which also requires the token for SetWorkerIdentity, a mutating RPC).
"""

from __future__ import annotations

from enginectl.fpm.v1 import fpm_identity_service_pb2 as pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as pb2_grpc
from enginectl.server.fpm.identity import IdentitySync, check_timeout, check_worker_id, rank_proto
from enginectl.server.limits import DEFAULT_GET_IDENTITY_TIMEOUT_S, DEFAULT_SET_IDENTITY_TIMEOUT_S
from enginectl.server.servicer_context import ServicerContext


def _timeout(
    request: pb2.SetWorkerIdentityRequest | pb2.GetWorkerIdentityRequest,
    default: float,
    context: ServicerContext,
) -> float:
    """The request's timeout (validated), cut to the call's own deadline when that is earlier."""
    given = request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else None
    timeout = check_timeout(given, default)
    remaining = context.time_remaining()
    return timeout if remaining is None else max(0.0, min(timeout, remaining))


class FpmIdentityServicer(pb2_grpc.FpmIdentityServiceServicer):
    """Serves SetWorkerIdentity and GetWorkerIdentity from an IdentitySync."""

    def __init__(self, identity: IdentitySync) -> None:
        self._identity = identity

    async def SetWorkerIdentity(
        self, request: pb2.SetWorkerIdentityRequest, context: ServicerContext
    ) -> pb2.SetWorkerIdentityResponse:
        check_worker_id(request.worker_id)
        acks = await self._identity.set(request.worker_id, _timeout(request, DEFAULT_SET_IDENTITY_TIMEOUT_S, context))
        return pb2.SetWorkerIdentityResponse(ranks=[rank_proto(a) for a in acks])

    async def GetWorkerIdentity(
        self, request: pb2.GetWorkerIdentityRequest, context: ServicerContext
    ) -> pb2.GetWorkerIdentityResponse:
        report = await self._identity.get(_timeout(request, DEFAULT_GET_IDENTITY_TIMEOUT_S, context))
        return pb2.GetWorkerIdentityResponse(
            ranks=[rank_proto(r) for r in report.ranks],
            consistent=report.consistent,
            await_worker_id=report.await_worker_id,
        )
