"""EngineAdapter: the one module that talks to vLLM's AsyncLLM.

Runs in the `enginectl serve` process. The rest of the server calls typed methods (`pause`,
`load`, `fingerprint`, `set_worker_identity`, ...); only this module and the worker-call
plumbing it owns (worker_calls.py) name the utilities and worker RPCs of the engine contract
(contract/engine.py) and read their answers into its structs. Everything that must hold on
every data-parallel rank goes through `_call_all`, one call per EngineCore, one result per
rank (vLLM's plain `call_utility_async` answers for the first engine only), or `_call_each`,
which bounds and reports each rank on its own; worker RPCs go through WorkerCalls, which
calls back into these two. The control plane calls in from its own loop (see
control_loop.py); every call into AsyncLLM runs on the engine's loop, and the death watch on
a thread of its own (`on_death`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from argparse import Namespace
from collections.abc import Callable, Coroutine
from multiprocessing import connection
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from enginectl.contract.census import RankCensus, RankConfigured
from enginectl.contract.engine import (
    DIGEST_RPC_TIMEOUT_S,
    QUICK_RPC_TIMEOUT_S,
    DigestJob,
    DigestSlice,
    FinishUpdate,
    LoadCheck,
    LoadPlan,
    LoadResult,
    PauseReason,
    RankGenerationState,
    RankIdentity,
    StageAck,
    StageResult,
    TransferAnswer,
    TransferStep,
    Utility,
    VllmUtility,
    WorkerDigest,
    WorkerRpc,
    read,
    wire,
)
from enginectl.contract.engine_config import EngineConfig
from enginectl.contract.groups import GroupJoined, GroupSpec
from enginectl.contract.prepare import Prepared, PreparePlan
from enginectl.server.control_loop import run_on
from enginectl.server.engine_cores import call_each_core
from enginectl.server.engine_info import EngineInfo, managed_ranks, shared_engine_id
from enginectl.server.engine_processes import reap_children
from enginectl.server.errors import ControlPlaneError
from enginectl.server.worker_calls import RankOutcome, WorkerCalls, engine_dead

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = structlog.get_logger("enginectl.engine")
T = TypeVar("T")


class EngineAdapter:
    """Wraps one AsyncLLM (all its DP ranks) for the control plane."""

    def __init__(self, llm: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        from vllm import __version__ as vllm_version

        self._llm = llm
        self._loop = loop  # the loop AsyncLLM and vLLM's HTTP server run on
        self._stopping = False  # set by `shutdown`: processes ending now are not a death
        self._death_cause: str | None = None
        self._on_death: Callable[[str], None] | None = None
        # Resolved with the cause when the engine dies; made on the engine's loop by on_death.
        self._death: asyncio.Future[str] | None = None
        # Every worker RPC goes through it (docs/architecture.md, "Worker calls and their
        # deadlines"); a late answer that never came is a death, reported through `_died`.
        self._worker_calls = WorkerCalls(self._call_all, self._call_each, lost=self._died, dead=self._is_dead)
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
            managed_ranks=managed_ranks(parallel),
            engine_id=shared_engine_id(parallel),
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

    @property
    def death_cause(self) -> str | None:
        """Why the engine died, once it did (None while it lives or after a `shutdown`)."""
        return self._death_cause

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(cause)` once, on the engine's loop, the moment vLLM's engine dies
        (never for `shutdown`). Call on the engine's loop, once, after `start`.

        Two signals, whichever comes first; both are events, nothing polls:
        - an EngineCore process exits: a thread blocks on the processes' sentinels, as vLLM's
          own monitor does (`CoreEngineProcManager.monitor_engine_liveness`, which then marks
          the engine dead but calls nobody back). This is the earliest sign of a killed or
          crashed EngineCore.
        - AsyncLLM's output handler ends: it stops only on EngineDeadError or another failure,
          after which `AsyncLLM.errored` is true, so this covers a death that leaves the
          processes up. AsyncLLM starts that handler itself when it is built on a running
          loop; `start` builds it on a thread, so it is started here instead of on the first
          request.
        """
        if self._on_death is not None:
            raise RuntimeError("on_death is set once")
        self._on_death = callback
        self._death = self._loop.create_future()
        llm = self._llm
        llm._run_output_handler()
        if llm.output_handler is not None:
            llm.output_handler.add_done_callback(lambda _: self._died(self._handler_cause()))
        processes = self._engine_processes()
        if processes:
            threading.Thread(
                target=self._watch_processes, args=(processes,), daemon=True, name="enginectl-engine-watch"
            ).start()
        if llm.errored:  # died before anyone was listening
            self._died("the engine was already dead when the control plane started watching it")

    def _engine_processes(self) -> list[Any]:
        """The EngineCore processes (multiprocessing), when this process started them."""
        manager = getattr(getattr(self._llm.engine_core, "resources", None), "engine_manager", None)
        return [p for p in getattr(manager, "processes", None) or () if hasattr(p, "sentinel")]

    def _watch_processes(self, processes: list[Any]) -> None:
        """Runs on its own thread: block until an EngineCore exits, then report it."""
        by_sentinel = {p.sentinel: p for p in processes}
        ended = connection.wait(list(by_sentinel))
        if self._stopping:
            return
        cause = "; ".join(_exited(by_sentinel[s]) for s in ended)
        try:
            self._loop.call_soon_threadsafe(self._died, cause)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    def _handler_cause(self) -> str:
        exited = [_exited(p) for p in self._engine_processes() if p.exitcode is not None]
        return "vLLM's output handler stopped (EngineDeadError)" + (f": {'; '.join(exited)}" if exited else "")

    def _died(self, cause: str) -> None:
        """On the engine's loop: the first report of a death calls back; later ones, and any
        during `shutdown`, are ignored."""
        if self._stopping or self._death_cause is not None:
            return
        self._death_cause = cause
        if self._death is not None and not self._death.done():
            self._death.set_result(cause)
        if self._on_death is not None:
            self._on_death(cause)

    async def _unless_dead(self, call: Coroutine[Any, Any, T]) -> T:
        """On the engine's loop: await `call`, but raise ENGINE_DEAD the moment the engine
        dies. vLLM leaves a utility call to a dead EngineCore pending for ever."""
        if self._death is None:
            return await call
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait((task, self._death), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            raise engine_dead(f"the engine died during the call ({self._death_cause})")
        return task.result()

    def _is_dead(self) -> bool:
        return self.errored or self._death_cause is not None

    async def _call_all(
        self, method: str, *args: Any, what: str | None = None, arrived: Callable[[list[Any]], None] | None = None
    ) -> list[Any]:
        """Call an EngineCore utility on every DP rank; one result per rank, in rank order.
        `arrived` sees the results on the engine's loop as soon as they are in; `what` names
        the call in the ENGINE_DEAD a failure there becomes (default `method`)."""

        async def call() -> list[Any]:  # on the engine's loop
            answers = list(await self._llm.engine_core.call_utility_all_async(method, *args))
            if arrived is not None:
                arrived(answers)
            return answers

        return await self._on_engine(method if what is None else what, lambda: self._unless_dead(call()))

    async def _on_engine(self, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run `make()` on the engine's loop; a failure there (but ours) is ENGINE_DEAD."""
        if self._llm.errored:
            raise engine_dead("the engine has died")
        try:
            return await run_on(self._loop, make())
        except (asyncio.CancelledError, ControlPlaneError):
            raise
        except Exception as exc:
            raise engine_dead(f"{what} failed on the engine: {exc}") from exc

    async def _call_each(
        self,
        method: str,
        *args: Any,
        timeout: float,
        arrived: Callable[[list[RankOutcome[Any]]], None] | None = None,
    ) -> list[RankOutcome[Any]]:
        """Call an EngineCore utility on every DP rank, each call on its own and bounded by
        `timeout`: one outcome per rank, in rank order. Unlike `_call_all`, a rank that raises
        or does not answer in time is named while the others' answers are kept. `arrived`
        sees the outcomes on the engine's loop as soon as they are in."""
        if self._llm.errored:
            raise engine_dead("the engine has died")

        async def call() -> list[RankOutcome[Any]]:  # on the engine's loop
            outcomes = await call_each_core(self._llm.engine_core, method, args, timeout)
            if arrived is not None:
                arrived(outcomes)
            return outcomes

        return await run_on(self._loop, call())

    # --- generation --------------------------------------------------------------------

    async def generation_state(self) -> list[RankGenerationState]:
        """Every rank's pause state and request counts (needs enginectl's EngineCore utilities)."""
        return [read(RankGenerationState, r) for r in await self._call_all(Utility.GENERATION_STATE.value)]

    async def is_paused(self) -> list[bool]:
        """Every rank's pause state, through vLLM's own utility (any scheduler has it)."""
        return [bool(p) for p in await self._call_all(VllmUtility.IS_SCHEDULER_PAUSED.value)]

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """vLLM's pause on every rank: mode "abort", "wait" (returns once drained) or "keep"."""
        await self._call_all(VllmUtility.PAUSE_SCHEDULER.value, mode, clear_cache)

    async def resume(self) -> None:
        await self._call_all(VllmUtility.RESUME_SCHEDULER.value)

    async def pause_reporting(
        self, mode: str, clear_cache: bool, reason: PauseReason = PauseReason.CALLER, if_running: bool = False
    ) -> list[RankGenerationState]:
        """`pause`, answering every rank's state from just before it: one round trip per rank
        (needs enginectl's EngineCore utilities). `reason` holds the pause from now on (what
        the ranks' FPM samples report). `if_running`: a rank paused already is left as it is."""
        answers = await self._call_all(Utility.PAUSE.value, mode, clear_cache, reason.value, if_running)
        return [read(RankGenerationState, r) for r in answers]

    async def hold(self, reason: PauseReason) -> None:
        """Every rank's pause in effect is held by `reason` from now on (what their FPM
        samples report); the schedulers are not touched."""
        await self._call_all(Utility.HOLD.value, reason.value)

    async def resume_reporting(self) -> list[RankGenerationState]:
        """`resume`, answering every rank's state from just before it (one round trip per rank)."""
        return [read(RankGenerationState, r) for r in await self._call_all(Utility.RESUME.value)]

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV on every rank, preempting running requests (they recompute): blocks
        computed with old weights must never be reused (worker/engine_core.py)."""
        await self._call_all(VllmUtility.RESET_PREFIX_CACHE.value, True, False)

    async def set_weight_version(self, version: str) -> None:
        """Stamp generated outputs with `version` on every rank (RequestOutput.weight_versions)."""
        await self._call_all(VllmUtility.SET_WEIGHT_VERSION.value, version)

    # --- weights -----------------------------------------------------------------------

    async def prepare(self, plan: PreparePlan) -> list[Prepared]:
        """Before an update writes anything, every worker checks it can read what `plan`
        names, as planned (worker/weights/prepare.py: header reads only); one answer per
        worker, rank by rank."""
        per_rank = await self._worker_calls.call(WorkerRpc.PREPARE, wire(plan), timeout=QUICK_RPC_TIMEOUT_S)
        return [read(Prepared, worker) for workers in per_rank for worker in workers]

    async def load(self, plan: LoadPlan, timeout: float) -> list[LoadResult]:
        """Every worker loads `plan`; one result per worker, rank by rank. `timeout` bounds
        the RPC itself (the workers stop at `plan.deadline`)."""
        per_rank = await self._worker_calls.call(WorkerRpc.LOAD, wire(plan), timeout=timeout)
        return [read(LoadResult, worker) for workers in per_rank for worker in workers]

    async def check_loaded(self, clear_kv: bool) -> list[LoadCheck]:
        """After a load, every worker checks that its model computes finite values (and with
        `clear_kv` zeroes its KV cache first: worker/weights/checks.py); one answer per worker,
        rank by rank."""
        per_rank = await self._worker_calls.call(WorkerRpc.CHECK_LOADED, clear_kv, timeout=DIGEST_RPC_TIMEOUT_S)
        return [read(LoadCheck, worker) for workers in per_rank for worker in workers]

    async def transfer(self, step: TransferStep, payload: Any, timeout: float) -> list[TransferAnswer]:
        """One step of vLLM's weight-transfer API on every worker (worker/weights/transfer/steps.py);
        one answer per worker, rank by rank. `timeout` bounds the RPC itself."""
        per_rank = await self._worker_calls.call(WorkerRpc.TRANSFER, step.value, payload, timeout=timeout)
        return [read(TransferAnswer, worker) for workers in per_rank for worker in workers]

    async def stage(self, plan: LoadPlan) -> list[list[StageAck]]:
        """Every worker starts staging `plan` on a thread of its own and answers at once."""
        per_rank = await self._worker_calls.call(WorkerRpc.STAGE, wire(plan), timeout=QUICK_RPC_TIMEOUT_S)
        return [[read(StageAck, w) for w in rank] for rank in per_rank]

    async def stage_result(self, token: str) -> list[list[StageResult]]:
        """How every worker's staging of `token` ended (or that it still runs)."""
        per_rank = await self._worker_calls.call(WorkerRpc.STAGE_RESULT, token, timeout=QUICK_RPC_TIMEOUT_S)
        return [[read(StageResult, w) for w in rank] for rank in per_rank]

    async def discard_staged(self, token: str, free: bool) -> int:
        """Every worker drops the staged set `token`; the bytes the workers held."""
        per_rank = await self._worker_calls.call(WorkerRpc.DISCARD_STAGED, token, free, timeout=QUICK_RPC_TIMEOUT_S)
        return sum(int(w) for rank in per_rank for w in rank)

    async def finish_update(self, request: FinishUpdate) -> list[list[WorkerDigest]]:
        """Cache reset, fingerprint, version stamp and resume: one round trip per rank.
        Returns the workers' sampled digests per rank ([] per rank without a token)."""
        answers = await self._call_all(Utility.FINISH_UPDATE.value, wire(request))
        return [[read(WorkerDigest, w) for w in rank] for rank in answers]

    async def fingerprint(self) -> list[list[WorkerDigest]]:
        """The sampled digest of the weights now, per rank and worker (milliseconds)."""
        answers = await self._worker_calls.call(WorkerRpc.FINGERPRINT, timeout=DIGEST_RPC_TIMEOUT_S)
        return [[read(WorkerDigest, w) for w in rank] for rank in answers]

    async def declare_fingerprint(self, token: str) -> list[list[WorkerDigest]]:
        """A declaration's sampled digest; the workers record its full baseline under `token`."""
        answers = await self._worker_calls.call(WorkerRpc.DECLARE_FINGERPRINT, token, timeout=DIGEST_RPC_TIMEOUT_S)
        return [[read(WorkerDigest, w) for w in rank] for rank in answers]

    async def full_digest(self, job: DigestJob, token: str) -> list[list[DigestSlice]]:
        """One slice of a full digest on every worker."""
        answers = await self._worker_calls.call(WorkerRpc.FULL_DIGEST, job.value, token, timeout=DIGEST_RPC_TIMEOUT_S)
        return [[read(DigestSlice, w) for w in rank] for rank in answers]

    async def init_group(self, spec: GroupSpec, timeout: float) -> list[RankOutcome[list[GroupJoined]]]:
        """Every worker starts joining the update group `spec` on a thread of its own; each
        rank answers at once (`joining`) or says why not, bounded by `timeout`."""
        outcomes = await self._worker_calls.call_per_rank(WorkerRpc.INIT_GROUP, wire(spec), timeout=timeout)
        return [o.map(lambda workers: [read(GroupJoined, w) for w in workers]) for o in outcomes]

    async def group_join_state(self, name: str, timeout: float) -> list[RankOutcome[list[GroupJoined]]]:
        """How every worker's join of `name` stands (each answers at once); bounded by `timeout`."""
        outcomes = await self._worker_calls.call_per_rank(WorkerRpc.GROUP_JOIN_STATE, name, timeout=timeout)
        return [o.map(lambda workers: [read(GroupJoined, w) for w in workers]) for o in outcomes]

    async def destroy_group(self, name: str) -> None:
        """Every worker leaves the update group `name`, or gives up joining it (a no-op where
        it is unknown)."""
        await self._worker_calls.call_per_rank(WorkerRpc.DESTROY_GROUP, name, timeout=QUICK_RPC_TIMEOUT_S + 1)

    # --- the start-up census ------------------------------------------------------------

    async def census(self, timeout: float) -> list[RankOutcome[RankCensus]]:
        """What runs on every rank, and where (server/census.py); each rank bounded by
        `timeout`, its workers by QUICK_RPC_TIMEOUT_S inside it."""
        outcomes = await self._call_each(Utility.CENSUS.value, timeout=timeout + QUICK_RPC_TIMEOUT_S)
        return [o.map(lambda answer: read(RankCensus, answer)) for o in outcomes]

    async def configure(self, config: EngineConfig, timeout: float) -> list[RankOutcome[RankConfigured]]:
        """Hand every rank this start's `config` (contract/engine_config.py), each bounded by
        `timeout`: a rank on another node learns the relay's endpoint and the channel secret
        only this way."""
        outcomes = await self._call_each(Utility.CONFIGURE.value, wire(config), timeout=timeout)
        return [o.map(lambda answer: read(RankConfigured, answer)) for o in outcomes]

    def rank_lost(self, cause: str) -> None:
        """A rank this process did not start is gone (server/rank_watch.py): the engine is
        dead, as when a local EngineCore exits. From any thread."""
        try:
            self._loop.call_soon_threadsafe(self._died, cause)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    # --- worker identity ---------------------------------------------------------------

    async def get_worker_identity(self, timeout: float) -> list[RankOutcome[RankIdentity]]:
        """The identity every rank holds; each rank bounded by `timeout`."""
        outcomes = await self._call_each(Utility.GET_WORKER_IDENTITY.value, timeout=timeout)
        return [o.map(lambda answer: read(RankIdentity, answer)) for o in outcomes]

    async def set_worker_identity(
        self, worker_id: str, generation: int, timeout: float
    ) -> list[RankOutcome[RankIdentity]]:
        """Every rank holds `worker_id` at `generation` from its next sample on."""
        outcomes = await self._call_each(Utility.SET_WORKER_IDENTITY.value, worker_id, generation, timeout=timeout)
        return [o.map(lambda answer: read(RankIdentity, answer)) for o in outcomes]

    def shutdown(self, timeout: float) -> None:
        """Stop the engine, then make sure no child process outlives us.

        Blocking; run it off the event loop. vLLM's own process kill can take longer than its
        timeout on a loaded 2-core machine, so we reap what is left ourselves.
        """
        self._stopping = True
        self._stop_output_handler(timeout)
        try:
            self._llm.shutdown(timeout=timeout)
        except Exception:  # keep going: the children must still be reaped
            log.exception("engine shutdown raised")
        reap_children(timeout)

    def _stop_output_handler(self, timeout: float) -> None:
        """From `shutdown`'s thread: cancel AsyncLLM's output handler, on the engine's loop,
        before the EngineCores stop. `vllm serve` stops the engine on its loop, which the
        handler then never gets back; here the loop is free, and the handler would report the
        EngineCores' orderly exit as an ERROR with a traceback."""
        handler = getattr(self._llm, "output_handler", None)
        if handler is None or handler.done():
            return

        async def cancel() -> None:
            handler.cancel()
            await asyncio.wait({handler}, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout)
        except (RuntimeError, concurrent.futures.TimeoutError):  # loop closed or busy: stop anyway
            pass


def _exited(process: Any) -> str:
    """'EngineCore_DP0 (pid 123) was killed by SIGKILL', or '... exited with code 1'."""
    code = process.exitcode
    if code is None:  # vLLM's monitor thread reaped it first and has not recorded the code yet
        how = "exited"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exited ({code})"
    else:
        how = f"exited with code {code}"
    return f"{process.name} (pid {process.pid}) {how}"
