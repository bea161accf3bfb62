"""Rollouts over gRPC on the control port: vLLM's `VllmEngine` service on the enginectl server,
every Generate ending with the weight version(s) its tokens were generated under.

Runs in the `enginectl serve` process. The service is vLLM's own servicer (`VllmEngineServicer`
of the `smg-grpc-servicer` package, the service the SMG gateway routes), built over the same
AsyncLLM. It runs where AsyncLLM and vLLM's HTTP server run, on the engine's loop; the gRPC
server lives on the control loop (server/control_loop.py). `RolloutRelay` carries each call
across: the request and the caller's cancellation to the engine's loop, responses and the
final status back; vLLM's servicer reads a copy of the call's context made on the control
loop (LocalContext, server/servicer_context.py). Nothing here touches weights or kernels.

Which weights produced the tokens: vLLM stamps every generated token with the label the
server last set on each EngineCore (the declared version, or UNDECLARED_LABEL) and reports
the spans on each finished completion (`CompletionOutput.weight_versions`). `_Recorder`
collects them for the call being relayed; the relay ends Generate with them as trailing
metadata (common/rollout_trailers.py, docs/rollouts.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from enginectl.common.rollout_trailers import DECLARED_TRAILER, REVISION_TRAILER, VERSIONS_TRAILER, encode_versions
from enginectl.contract.engine import UNDECLARED_LABEL
from enginectl.server.errors import CallAborted
from enginectl.server.servicer_context import LocalContext, ServicerContext, status_code

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from enginectl.server.weights.version.ledger import WeightVersionLedger
    from enginectl.weights.v1 import weight_update_service_pb2

    GenerationStateReader = Callable[[], Awaitable[weight_update_service_pb2.GenerationState]]


SERVICE = "vllm.grpc.engine.VllmEngine"
# Rollout RPCs that change what the engine serves or costs it: guarded by the token whenever
# the server has one. Generation itself is the data plane, open unless the operator asks.
ADMIN_RPCS = ("FlushCache", "StartProfile", "StopProfile")

# The labels of the call being relayed, appended by `_Recorder.generate` on the engine's loop.
_labels: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("enginectl_rollout_labels", default=None)


def available() -> bool:
    """Whether vLLM's gRPC servicer is installed (the server extras install it)."""
    return importlib.util.find_spec("smg_grpc_servicer") is not None


def weight_trailers(labels: list[str], ledger: WeightVersionLedger) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a generation whose tokens carried `labels` (in order; [] when it
    generated no token: then the ledger's state now stands for it)."""
    if not labels:
        state = ledger.state
        labels = [state.version if state.declared and state.version is not None else UNDECLARED_LABEL]
    declared = [label for label in labels if label != UNDECLARED_LABEL]
    whole = "true" if len(declared) == len(labels) else "false" if not declared else "partial"
    trailers = [(DECLARED_TRAILER, whole)]
    if declared:
        trailers.append((VERSIONS_TRAILER, encode_versions(declared)))
    revision = ledger.revision_of(labels[-1]) if labels[-1] != UNDECLARED_LABEL else None
    if revision is not None:
        trailers.append((REVISION_TRAILER, str(revision)))
    return tuple(trailers)


class _Recorder:
    """The AsyncLLM vLLM's servicer sees: the engine itself, except that `generate` also
    records the weight-version labels of each finished completion for the relayed call."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        labels = _labels.get()
        async for output in self._llm.generate(*args, **kwargs):
            if labels is not None:
                for completion in output.outputs:
                    for span in completion.weight_versions or ():
                        if not labels or labels[-1] != span.version:
                            labels.append(span.version)
            yield output


_END = object()


class RolloutRelay:
    """The `VllmEngine` servicer on the control loop: each RPC runs vLLM's servicer on the
    engine's loop and relays its answer; Generate adds the weight-version trailers."""

    def __init__(
        self,
        servicer: Any,
        engine_loop: asyncio.AbstractEventLoop,
        ledger: WeightVersionLedger,
        unhealthy: Callable[[], str],
        generation_state: GenerationStateReader | None = None,
        started: float | None = None,
    ) -> None:
        self._servicer = servicer
        self._engine_loop = engine_loop
        self._ledger = ledger
        self._unhealthy = unhealthy  # why gRPC health is NOT_SERVING ("" while SERVING)
        self._generation_state = generation_state  # enginectl's pause state and request counts
        self._started = time.time() if started is None else started

    async def HealthCheck(self, request: Any, context: ServicerContext) -> Any:
        """vLLM's health check, unhealthy whenever the control plane's gRPC health is
        NOT_SERVING (quarantine, awaiting identity, shutting down): a gateway that asks only
        this (SMG) must take such an engine out of rotation too."""
        why = self._unhealthy()
        if why:
            from smg_grpc_proto import vllm_engine_pb2

            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=why)
        return await self._unary("HealthCheck", request, context)

    async def Generate(self, request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        labels: list[str] = []
        async for response in self._stream("Generate", request, context, labels):
            yield response
        context.set_trailing_metadata(weight_trailers(labels, self._ledger))

    # Every other RPC: vLLM's servicer's answer, relayed as it is.

    async def Embed(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("Embed", request, context)

    async def FlushCache(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("FlushCache", request, context)

    async def StartProfile(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("StartProfile", request, context)

    async def StopProfile(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("StopProfile", request, context)

    async def Abort(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("Abort", request, context)

    async def GetModelInfo(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("GetModelInfo", request, context)

    async def GetServerInfo(self, request: Any, context: ServicerContext) -> Any:
        """vLLM's answer, with what a gateway reads of it filled from enginectl's state:
        `is_paused` (paused on any rank, by a caller or an update), `active_requests` (running
        and waiting on every rank) and `uptime_seconds`."""
        answer = await self._unary("GetServerInfo", request, context)
        answer.uptime_seconds = max(0.0, time.time() - self._started)
        if self._generation_state is not None:
            state = await self._generation_state()
            answer.is_paused = state.paused
            answer.active_requests = state.num_running_requests + state.num_waiting_requests
        return answer

    async def GetLoads(self, request: Any, context: ServicerContext) -> Any:
        return await self._unary("GetLoads", request, context)

    async def GetTokenizer(self, request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        async for item in self._stream("GetTokenizer", request, context):
            yield item

    async def SubscribeKvEvents(self, request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        async for item in self._stream("SubscribeKvEvents", request, context):
            yield item

    async def _unary(self, method: str, request: Any, context: ServicerContext) -> Any:
        call, shim = getattr(self._servicer, method), LocalContext.copy_of(context)
        future = asyncio.run_coroutine_threadsafe(call(request, shim), self._engine_loop)
        try:
            answer = await asyncio.wrap_future(future)
        except CallAborted as aborted:
            await context.abort(status_code(aborted.status), aborted.status.message)
        shim.apply(context)
        return answer

    async def _stream(
        self, method: str, request: Any, context: ServicerContext, labels: list[str] | None = None
    ) -> AsyncIterator[Any]:
        control_loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        call = getattr(self._servicer, method)
        shim = LocalContext.copy_of(context)

        async def pump() -> None:  # on the engine's loop
            _labels.set(labels)
            try:
                async for item in call(request, shim):
                    control_loop.call_soon_threadsafe(queue.put_nowait, item)
            except BaseException as exc:
                control_loop.call_soon_threadsafe(queue.put_nowait, exc)
                raise
            control_loop.call_soon_threadsafe(queue.put_nowait, _END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._engine_loop)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    shim.apply(context)
                    return
                if isinstance(item, CallAborted):
                    await context.abort(status_code(item.status), item.status.message)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # the caller went away: vLLM aborts the request


def _methods() -> list[str]:
    from smg_grpc_proto import vllm_engine_pb2

    return [m.name for m in vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].methods]


def guarded_methods(guard_all: bool) -> frozenset[str]:
    """Methods ("/pkg.Service/Method") that need the token when the server has one: the
    admin RPCs, or every RPC with --token-guards-rollouts (server/interceptors.py)."""
    return frozenset(f"/{SERVICE}/{name}" for name in _methods() if guard_all or name in ADMIN_RPCS)


def open_methods(guard_all: bool) -> frozenset[str]:
    """Methods that need no token though they are not reads (Generate, Embed, Abort), unless
    --token-guards-rollouts."""
    if guard_all:
        return frozenset()
    return frozenset(f"/{SERVICE}/{name}" for name in _methods()) - guarded_methods(False)


class RolloutService:
    """vLLM's `VllmEngine` service for the control plane's server (server/grpc_server.py).
    With `guard_all` (--token-guards-rollouts) every RPC of it needs the token."""

    name = SERVICE

    def __init__(
        self,
        llm: AsyncLLM,
        engine_loop: asyncio.AbstractEventLoop,
        *,
        log_requests: bool = False,
        guard_all: bool = False,
    ) -> None:
        from smg_grpc_proto import vllm_engine_pb2
        from smg_grpc_servicer.vllm import VllmEngineServicer

        self.descriptor = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]
        self._started = time.time()
        self._servicer = VllmEngineServicer(_Recorder(llm), self._started)
        # Its per-request INFO line only with vLLM's --enable-log-requests, like vLLM's HTTP API.
        logging.getLogger("smg_grpc_servicer").setLevel(logging.INFO if log_requests else logging.WARNING)
        self._engine_loop = engine_loop
        self.guarded_methods = guarded_methods(guard_all)  # see server/interceptors.py
        self.open_methods = open_methods(guard_all)

    @property
    def rpcs(self) -> list[str]:
        """Full names ("pkg.Service/Method") of the service's RPCs that the relay serves."""
        return [f"{SERVICE}/{method.name}" for method in self.descriptor.methods if hasattr(RolloutRelay, method.name)]

    def add_to_server(
        self,
        server: grpc.aio.Server,
        ledger: WeightVersionLedger,
        unhealthy: Callable[[], str],
        generation_state: GenerationStateReader | None = None,
    ) -> None:
        """Serve VllmEngine on `server`; `unhealthy()` says why the control plane is
        NOT_SERVING ("" while SERVING), which HealthCheck reports as unhealthy, and
        `generation_state()` what GetServerInfo reports of pauses and requests."""
        from smg_grpc_proto import vllm_engine_pb2_grpc

        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            RolloutRelay(self._servicer, self._engine_loop, ledger, unhealthy, generation_state, self._started), server
        )
