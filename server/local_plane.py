"""LocalPlane: the control plane's unary RPCs as typed calls, made in process from another loop.

Runs in the `enginectl serve` process. The HTTP routes (server/http/) await these calls on the
engine's loop (vLLM's HTTP server); each call is carried to the control loop
(server/control_loop.py) and run there by the local endpoint (server/local_endpoint.py),
through the interceptor and the servicer a gRPC call reaches: the token, the refusals, logs,
metrics, the ledger and the update state machine, as on the gRPC port. Nothing here touches
weights.

One call object per RPC it carries (every unary RPC of WeightUpdateService, and the calls
the HTTP routes make of the other services), as temporalio's `ServiceCall`: its path and
response type come from its service's descriptor, its types from the servicer method that
serves it, so a caller reads `plane.weight_update.pause_generation(request, caller)` and gets
a PauseGenerationResponse.
An RPC renamed in the protos or the servicers fails mypy and the plane's construction, not a
route when it runs. A refused or failed call raises CallAborted with the google.rpc.Status a
gRPC client would have received.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any, Generic, TypeVar, cast

import grpc
from google.longrunning import operations_pb2
from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_health.v1 import health, health_pb2

from enginectl.server.errors import CallAborted
from enginectl.server.local_endpoint import LocalEndpoint
from enginectl.server.rollouts import RolloutRelay
from enginectl.server.servicer_context import ServicerContext
from enginectl.server.weights.services import OperationsServicer, WeightUpdateServicer, WeightVersionServicer
from enginectl.weights.v1 import weight_update_service_pb2, weight_version_service_pb2

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

# A read or a pause: answered in milliseconds, bounded anyway.
UNARY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Caller:
    """Who makes a call, as a gRPC client says it in metadata: `authorization` (passed on as
    it came, e.g. an HTTP request's Authorization header), a request id for the logs and its
    user agent; and its address, as gRPC names a peer ("ipv4:10.0.0.7:51234"). The last two
    name who staged a set or took over an engine (docs/weights.md, "A trainer that restarts")."""

    authorization: str | None = None
    request_id: str | None = None
    peer: str = "local"
    user_agent: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = (
            ("authorization", self.authorization),
            ("x-request-id", self.request_id),
            ("user-agent", self.user_agent),
        )
        return tuple((key, value) for key, value in pairs if value)


ANONYMOUS = Caller()


class UnaryCall(Generic[Req, Resp]):
    """One unary RPC of the control plane, awaited from any loop, run on the control loop."""

    def __init__(
        self, endpoint: LocalEndpoint, control_loop: asyncio.AbstractEventLoop, method: str, response: type[Resp]
    ) -> None:
        self.method = method  # "/pkg.Service/Method"
        self._endpoint = endpoint
        self._loop = control_loop
        self._response = response

    async def __call__(self, request: Req, caller: Caller = ANONYMOUS, *, timeout: float = UNARY_TIMEOUT_S) -> Resp:
        """The RPC's response to `request`, made by `caller` within `timeout` seconds; raises
        CallAborted with the status the call ended with."""

        async def run() -> Resp:
            answer = await self._endpoint.call(self.method, request, caller.metadata(), timeout, caller.peer)
            if not isinstance(answer, self._response):
                message = f"{self.method} answered a {type(answer).__name__}"
                raise CallAborted(status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message))
            return answer

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))


class _Service:
    """Makes the calls of the one service a generated module defines."""

    def __init__(self, module: ModuleType, endpoint: LocalEndpoint, control_loop: asyncio.AbstractEventLoop) -> None:
        (self._descriptor,) = module.DESCRIPTOR.services_by_name.values()
        self._endpoint = endpoint
        self._loop = control_loop

    def unary(self, rpc: Callable[[Any, Req, ServicerContext], Awaitable[Resp]]) -> UnaryCall[Req, Resp]:
        """The call of the RPC that `rpc`, a servicer's method, serves (it bears its name)."""
        method: descriptor.MethodDescriptor | None = self._descriptor.methods_by_name.get(rpc.__name__)
        if method is None or method.client_streaming or method.server_streaming:
            raise TypeError(f"{self._descriptor.full_name} has no unary RPC {rpc.__name__}")
        response = cast("type[Resp]", message_factory.GetMessageClass(method.output_type))
        return UnaryCall(self._endpoint, self._loop, f"/{self._descriptor.full_name}/{method.name}", response)


class WeightVersionCalls:
    """enginectl.weights.v1.WeightVersionService: the calls the HTTP routes make."""

    def __init__(self, rpc: _Service) -> None:
        self.get_weight_version = rpc.unary(WeightVersionServicer.GetWeightVersion)
        self.set_weight_version = rpc.unary(WeightVersionServicer.SetWeightVersion)


class WeightUpdateCalls:
    """enginectl.weights.v1.WeightUpdateService: every unary RPC (UpdateWeightsFromTensors
    streams)."""

    def __init__(self, rpc: _Service) -> None:
        self.get_server_info = rpc.unary(WeightUpdateServicer.GetServerInfo)
        self.pause_generation = rpc.unary(WeightUpdateServicer.PauseGeneration)
        self.resume_generation = rpc.unary(WeightUpdateServicer.ResumeGeneration)
        self.get_generation_state = rpc.unary(WeightUpdateServicer.GetGenerationState)
        self.update_weights_from_disk = rpc.unary(WeightUpdateServicer.UpdateWeightsFromDisk)
        self.init_weights_update_group = rpc.unary(WeightUpdateServicer.InitWeightsUpdateGroup)
        self.destroy_weights_update_group = rpc.unary(WeightUpdateServicer.DestroyWeightsUpdateGroup)
        self.update_weights_from_distributed = rpc.unary(WeightUpdateServicer.UpdateWeightsFromDistributed)
        self.update_weights_from_ipc = rpc.unary(WeightUpdateServicer.UpdateWeightsFromIpc)
        self.commit_staged_weights = rpc.unary(WeightUpdateServicer.CommitStagedWeights)
        self.discard_staged_weights = rpc.unary(WeightUpdateServicer.DiscardStagedWeights)
        self.init_weight_transfer_engine = rpc.unary(WeightUpdateServicer.InitWeightTransferEngine)
        self.start_weight_update = rpc.unary(WeightUpdateServicer.StartWeightUpdate)
        self.update_weights = rpc.unary(WeightUpdateServicer.UpdateWeights)
        self.finish_weight_update = rpc.unary(WeightUpdateServicer.FinishWeightUpdate)
        self.shutdown_weight_transfer_engine = rpc.unary(WeightUpdateServicer.ShutdownWeightTransferEngine)


class OperationsCalls:
    """google.longrunning.Operations, over the update Operations: the call the HTTP routes
    make."""

    def __init__(self, rpc: _Service) -> None:
        self.wait_operation = rpc.unary(OperationsServicer.WaitOperation)


class HealthCalls:
    """grpc.health.v1.Health, as ServingHealth answers it (server/health.py)."""

    def __init__(self, rpc: _Service) -> None:
        self.check: UnaryCall[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse] = rpc.unary(
            health.HealthServicer.Check
        )


class VllmEngineCalls:
    """vLLM's VllmEngine, as RolloutRelay serves it (server/rollouts.py): the calls the HTTP
    routes make."""

    def __init__(self, rpc: _Service) -> None:
        self.flush_cache = rpc.unary(RolloutRelay.FlushCache)
        self.health_check = rpc.unary(RolloutRelay.HealthCheck)


class LocalPlane:
    """The control plane's RPCs served through `endpoint` (ControlPlaneServer.local), as typed
    calls run on `control_loop`, the loop that owns the control plane."""

    def __init__(self, endpoint: LocalEndpoint, control_loop: asyncio.AbstractEventLoop) -> None:
        self._endpoint = endpoint
        self._loop = control_loop
        self.weight_version = WeightVersionCalls(self._service(weight_version_service_pb2))
        self.weight_update = WeightUpdateCalls(self._service(weight_update_service_pb2))
        self.operations = OperationsCalls(self._service(operations_pb2))
        self.health = HealthCalls(self._service(health_pb2))

    def _service(self, module: ModuleType) -> _Service:
        return _Service(module, self._endpoint, self._loop)

    @cached_property
    def vllm_engine(self) -> VllmEngineCalls:
        """vLLM's VllmEngine; ImportError where smg-grpc-servicer's protos are not installed (a
        call the server does not serve answers UNIMPLEMENTED, as over gRPC)."""
        from smg_grpc_proto import vllm_engine_pb2

        return VllmEngineCalls(self._service(vllm_engine_pb2))
