"""EngineAdapter: the one module that talks to vLLM's AsyncLLM.

Runs in the `enginectl serve` process. Everything that must hold on every data-parallel rank
goes through `call_all`, one call per EngineCore, one result per rank (vLLM's plain
`call_utility_async` answers for the first engine only). The control plane calls in from its
own loop (see control_loop.py); every call into AsyncLLM runs on the engine's loop.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from argparse import Namespace
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import psutil
import structlog

from enginectl.server.control_loop import run_on
from enginectl.server.errors import ControlPlaneError, Reason

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = structlog.get_logger("enginectl.engine")


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is, fixed at start (safe to read from any thread)."""

    model: str
    served_model_names: tuple[str, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    quantization: str
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    vllm_version: str

    @property
    def num_workers(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size


class EngineAdapter:
    """Wraps one AsyncLLM (all its DP ranks) for the control plane."""

    def __init__(self, llm: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        from vllm import __version__ as vllm_version

        self._llm = llm
        self._loop = loop  # the loop AsyncLLM and vLLM's HTTP server run on
        model, parallel = llm.model_config, llm.vllm_config.parallel_config
        served = model.served_model_name
        self.info = EngineInfo(
            model=str(model.model),
            served_model_names=tuple(served) if isinstance(served, (list, tuple)) else (str(served),),
            dtype=str(model.dtype).removeprefix("torch."),
            quantization=str(model.quantization or ""),
            data_parallel_size=int(parallel.data_parallel_size),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            pipeline_parallel_size=int(parallel.pipeline_parallel_size),
            vllm_version=str(vllm_version),
        )

    @classmethod
    def start(cls, args: Namespace, loop: asyncio.AbstractEventLoop) -> EngineAdapter:
        """Build the engine from vLLM CLI arguments (as `vllm serve` would).

        Blocking; may run off the loop (AsyncLLM starts its output handler lazily on `loop`).
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs.from_cli_args(args)
        usage = UsageContext.OPENAI_API_SERVER
        vllm_config = engine_args.create_engine_config(usage_context=usage)
        llm = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=usage,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
        )
        return cls(llm, loop)

    @property
    def client(self) -> AsyncLLM:
        """The AsyncLLM itself, for vLLM's HTTP server to share."""
        return self._llm

    @property
    def errored(self) -> bool:
        return bool(self._llm.errored)

    async def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call an EngineCore utility on every DP rank; one result per rank, in rank order."""
        if self._llm.errored:
            raise _engine_dead("the engine has died")
        try:
            return list(await run_on(self._loop, self._llm.engine_core.call_utility_all_async(method, *args)))
        except (asyncio.CancelledError, ControlPlaneError):
            raise
        except Exception as exc:
            raise _engine_dead(f"{method} failed on the engine: {exc}") from exc

    async def call_each(self, method: str, *args: Any, timeout: float) -> list[RankOutcome]:
        """Call an EngineCore utility on every DP rank, each call on its own and bounded by
        `timeout`: one outcome per rank, in rank order. Unlike `call_all`, a rank that raises
        or does not answer in time is named while the others' answers are kept."""
        if self._llm.errored:
            raise _engine_dead("the engine has died")
        return await run_on(self._loop, _call_each(self._llm.engine_core, method, args, timeout))

    async def set_weight_version(self, version: str) -> None:
        """Stamp generated outputs with `version` on every rank (RequestOutput.weight_versions)."""
        await self.call_all("set_weight_version", version)

    def shutdown(self, timeout: float) -> None:
        """Stop the engine, then make sure no child process outlives us.

        Blocking; run it off the event loop. vLLM's own process kill can take longer than its
        timeout on a loaded 2-core machine, so we reap what is left ourselves.
        """
        try:
            self._llm.shutdown(timeout=timeout)
        except Exception:  # keep going: the children must still be reaped
            log.exception("engine shutdown raised")
        reap_children(timeout)


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer to `call_each`: `result`, or a `failure` reason ("RANK_TIMEOUT",
    "RANK_ERROR" or "ENGINE_DEAD") with a message."""

    dp_rank: int
    result: Any = None
    failure: str = ""
    message: str = ""


async def _call_each(core: Any, method: str, args: tuple[Any, ...], timeout: float) -> list[RankOutcome]:
    """Runs on the engine's loop: one utility call per EngineCore, all started at once."""
    from vllm.v1.engine.exceptions import EngineDeadError

    ranks = [int.from_bytes(engine, "little") for engine in core.core_engines]
    calls = [
        asyncio.ensure_future(core._call_utility_async(method, *args, engine=engine))
        for engine in core.core_engines
    ]
    await asyncio.wait(calls, timeout=max(timeout, 0.0))
    outcomes = []
    for rank, call in zip(ranks, calls):
        if not call.done():
            call.cancel()
            outcomes.append(RankOutcome(rank, failure="RANK_TIMEOUT", message=f"no answer within {timeout:.3f}s"))
        elif isinstance(call.exception(), EngineDeadError):
            outcomes.append(RankOutcome(rank, failure="ENGINE_DEAD", message=str(call.exception())))
        elif call.exception() is not None:
            outcomes.append(RankOutcome(rank, failure="RANK_ERROR", message=str(call.exception())))
        else:
            outcomes.append(RankOutcome(rank, result=call.result()))
    return outcomes


def reap_children(timeout: float) -> None:
    """Join every child process; terminate, then kill, whatever is still alive."""
    for child in multiprocessing.active_children():
        child.join(timeout)
    _stop_resource_tracker()
    me = psutil.Process(os.getpid())
    children = me.children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        log.warning("killing child process that ignored SIGTERM", pid=child.pid)
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    for child in multiprocessing.active_children():  # collect exit codes, no zombies
        child.join(0)


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker ignores SIGTERM and only exits when its pipe closes;
    close it now (it then unlinks anything leaked) instead of leaving it behind."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)
    if stop is not None and getattr(tracker, "_pid", None) is not None:
        try:
            stop()
        except (OSError, ChildProcessError):
            pass


def _engine_dead(message: str) -> ControlPlaneError:
    return ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD, message)
