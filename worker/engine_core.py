"""enginectl's weight-update utilities of vLLM's EngineCore, and its wrapped `collective_rpc`.

Runs inside each EngineCore process, on the engine thread, between two steps. Importing this
module changes nothing in vLLM: `attach()` (worker/attach.py) puts these functions on vLLM's
EngineCore class. The `enginectl serve` process calls them on every rank, by the names of the
engine contract (contract/engine.py `Utility`).

They also keep the rank's generation state for its FPM samples (worker/fpm/generation.py,
held by enginectl's scheduler; nothing to keep under another scheduler): who paused, and
APPLYING while a weight load runs. Every worker RPC of enginectl (WorkerRpc) reaches the workers through
`enginectl_worker_call` (Utility.WORKER_CALL), which bounds it: vLLM's MultiprocExecutor pairs
the workers' answers with calls by order, so an answer that arrives after its call's timeout
would be read as the next model step's output and kill the engine. Here a call that outlives
its timeout has its late answers drained (the engine stays in step and the call fails with a
LateAnswer), or, when they do not come within LATE_ANSWER_GRACE_S, the executor is stopped so
that no step can misread them, and the server takes the engine for dead
(docs/architecture.md, "Worker calls and their deadlines"). A LOAD marks the rank APPLYING
for exactly its duration, with no round trip of its own, and the engine thread waits for it
without vLLM's spin (`_waiting_without_spin`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from vllm.v1.engine.core import EngineCore

import enginectl
from enginectl.common.host import host_identity
from enginectl.contract.census import RankCensus, WorkerCensus
from enginectl.contract.engine import (
    DIGEST_RPC_TIMEOUT_S,
    LATE_ANSWER_GRACE_S,
    QUICK_RPC_TIMEOUT_S,
    FinishUpdate,
    LateAnswer,
    PauseReason,
    RankGenerationState,
    WorkerCall,
    WorkerRpc,
    read,
    wire,
)
from enginectl.worker.fpm.generation import RankGeneration

log = logging.getLogger("enginectl.worker.engine_core")


def _generation(core: EngineCore) -> RankGeneration | None:
    """The rank's generation state for its FPM samples (None under another scheduler)."""
    generation = getattr(core.scheduler, "fpm_generation", None)
    return generation if isinstance(generation, RankGeneration) else None


def enginectl_generation_state(self: EngineCore) -> Any:
    """This rank's pause state and request counts (a RankGenerationState)."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler: Any = self.scheduler
    parallel = self.vllm_config.parallel_config
    return wire(
        RankGenerationState(
            dp_rank=int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0),
            paused=getattr(scheduler, "pause_state", PauseState.UNPAUSED) != PauseState.UNPAUSED,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
        )
    )


def enginectl_pause(
    self: EngineCore, mode: str, clear_cache: bool, reason: str = PauseReason.CALLER.value, if_running: bool = False
) -> Any:
    """vLLM's pause_scheduler, answering this rank's RankGenerationState from just before it
    (once the pause completed, as vLLM's own utility answers). `reason` (a PauseReason) holds
    the pause from now on, also when generation was paused already; with `if_running`, a
    rank paused already is left as it is (an update reads the state and pauses in one trip)."""
    before = enginectl_generation_state(self)
    if if_running and read(RankGenerationState, before).paused:
        return before
    generation = _generation(self)
    if generation is None:
        pausing = self.pause_scheduler(mode, clear_cache)  # type: ignore[arg-type]
    else:
        with generation.pausing(PauseReason(reason)):
            pausing = self.pause_scheduler(mode, clear_cache)  # type: ignore[arg-type]
    if pausing is None:
        return before
    answer: Future[Any] = Future()

    def paused(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(before)

    pausing.add_done_callback(paused)
    return answer


def enginectl_resume(self: EngineCore) -> Any:
    """vLLM's resume_scheduler, answering this rank's RankGenerationState from just before."""
    before = enginectl_generation_state(self)
    self.resume_scheduler()
    return before


def enginectl_hold(self: EngineCore, reason: str) -> None:
    """The pause in effect on this rank is held by `reason` (a PauseReason) from now on; the
    scheduler is not touched, and a running rank stays running."""
    generation = _generation(self)
    if generation is not None:
        generation.hold(PauseReason(reason))


def enginectl_finish_update(self: EngineCore, request_wire: Any) -> Any:
    """The end of a successful weight update (a FinishUpdate) in one round trip instead of
    four: reset the prefix cache, fingerprint the weights (workers keep the full one under the
    token), stamp the version on outputs, resume. Answers the workers' WorkerDigests ([]
    without a token)."""
    request = read(FinishUpdate, request_wire)
    if request.reset_cache:
        # Running requests (kept by a KEEP pause) hold blocks computed with the old weights: a
        # reset that spares them fails quietly and new requests would reuse that KV. Preempt
        # them as vLLM's own pause(clear_cache) does; they recompute with the new weights.
        if not self.reset_prefix_cache(True, False):
            raise RuntimeError("the prefix cache could not be reset")
    fingerprints: list[Any] = []
    if request.fingerprint_token:
        call = read(
            WorkerCall,
            enginectl_worker_call(
                self, WorkerRpc.DECLARE_FINGERPRINT.value, DIGEST_RPC_TIMEOUT_S, [request.fingerprint_token]
            ),
        )
        if call.late is not None:
            raise RuntimeError(call.late.message)
        fingerprints = call.answers
    if request.version is not None:
        self.set_weight_version(request.version)
    if request.resume:
        self.resume_scheduler()
    elif (generation := _generation(self)) is not None:
        generation.update_finished_paused()
    return fingerprints


def enginectl_census(self: EngineCore) -> Any:
    """This rank in the start-up census (a RankCensus; server/census.py): its enginectl, its
    scheduler, its host, and every worker's census, or why its workers could not answer (one
    without enginectl's worker extension fails the call)."""
    host = host_identity()
    scheduler = type(self.scheduler)
    parallel = self.vllm_config.parallel_config
    workers: list[WorkerCensus] = []
    error = ""
    try:
        call = read(WorkerCall, enginectl_worker_call(self, WorkerRpc.CENSUS.value, QUICK_RPC_TIMEOUT_S, []))
        if call.late is not None:
            error = call.late.message
        else:
            workers = [read(WorkerCensus, answer) for answer in call.answers]
    except Exception as exc:  # noqa: BLE001 - answered: the census names this rank's workers
        error = f"{type(exc).__name__}: {exc}"
    return wire(
        RankCensus(
            dp_rank=int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0),
            enginectl_version=enginectl.__version__,
            enginectl_scheduler=_generation(self) is not None,
            scheduler=f"{scheduler.__module__}.{scheduler.__qualname__}",
            hostname=host.hostname,
            boot_id=host.boot_id,
            pid=os.getpid(),
            workers=workers,
            workers_error=error,
            config_digest=held.digest() if (held := getattr(self.scheduler, "fpm_config", None)) is not None else "",
        )
    )


def enginectl_worker_call(self: EngineCore, rpc: str, timeout: float, args: list[Any]) -> Any:
    """The worker RPC `rpc` on every worker of this rank, bounded by `timeout`: a WorkerCall
    with every worker's answer in worker order, or its LateAnswer (see the module docstring).
    A worker's failure raises, as vLLM's collective_rpc does, once every answer is in."""
    if rpc not in _WORKER_RPCS:
        raise ValueError(f"{rpc!r} is not a worker RPC of enginectl")
    executor: Any = getattr(self, "model_executor", None)
    queues = getattr(executor, "response_mqs", None)
    requests = getattr(executor, "rpc_broadcast_mq", None)
    if not queues or requests is None or getattr(executor, "futures_queue", None):
        # Not vLLM's MultiprocExecutor (the uniprocess one runs the call inline: no answer can
        # be late), or a step's answer is still due (never between two steps here).
        return wire(WorkerCall(answers=list(collective_rpc(self, rpc, timeout, tuple(args)))))
    if executor.is_failed:
        raise RuntimeError("the executor has failed")
    generation = _generation(self) if rpc == WorkerRpc.LOAD.value else None
    with (
        _waiting_without_spin(self) if rpc == WorkerRpc.LOAD.value else contextlib.nullcontext(),
        generation.applying() if generation is not None else contextlib.nullcontext(),
    ):
        return wire(_bounded(executor, rpc, timeout, tuple(args)))


def _bounded(executor: Any, rpc: str, timeout: float, args: tuple[Any, ...]) -> WorkerCall:
    """Send `rpc` to every worker of `executor` and read each worker's answer, in order, until
    `timeout`; a worker still inside the call then has its answer waited for and dropped."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    executor.rpc_broadcast_mq.enqueue((rpc, args, {}, None))
    deadline = time.monotonic() + timeout
    answers: list[Any] = []
    failures: list[str] = []
    queues = list(executor.response_mqs)
    for index, queue in enumerate(queues):
        try:
            status, result = queue.dequeue(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return WorkerCall(late=_drain_late(executor, rpc, timeout, queues[index:]))
        if status != WorkerProc.ResponseStatus.SUCCESS:
            failures.append(str(result))  # read every answer first: none may stay queued
        answers.append(result)
    if failures:
        raise RuntimeError(f"a worker failed in {rpc}: {failures[0]}")
    return WorkerCall(answers=answers)


def _drain_late(executor: Any, rpc: str, timeout: float, queues: list[Any]) -> LateAnswer:
    """Wait up to LATE_ANSWER_GRACE_S for the answers still due on `queues` and drop them; if
    one does not come, stop the executor: its next step would read that answer as its output."""
    end = time.monotonic() + LATE_ANSWER_GRACE_S
    for queue in queues:
        try:
            queue.dequeue(timeout=max(end - time.monotonic(), 0.0))
        except TimeoutError:
            executor.is_failed = True  # vLLM's collective_rpc refuses every call from now on
            message = (
                f"worker RPC {rpc} outlived its {timeout:.3f}s timeout and gave no answer within "
                f"{LATE_ANSWER_GRACE_S:.0f}s more: the engine can no longer pair answers with calls and was stopped"
            )
            log.error("enginectl: %s", message)
            return LateAnswer(rpc, timeout, drained=False, message=message)
    message = f"worker RPC {rpc} outlived its {timeout:.3f}s timeout; its late answer was dropped"
    log.warning("enginectl: %s", message)
    return LateAnswer(rpc, timeout, drained=True, message=message)


_WORKER_RPCS = frozenset(rpc.value for rpc in WorkerRpc)


# vLLM's own method, also when this module is imported again after attach() installed the
# wrapper below: the wrapper must never wrap itself.
_vllm_collective_rpc: Callable[..., list[Any]] = getattr(
    EngineCore.collective_rpc, "__wrapped__", EngineCore.collective_rpc
)


def collective_rpc(
    self: EngineCore,
    method: Any,
    timeout: float | None = None,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """vLLM's collective_rpc (same signature: vLLM reads it to convert utility arguments);
    a weight load (WorkerRpc.LOAD) marks the rank APPLYING while it runs, and the engine
    thread waits for it, and for a transfer engine's step (WorkerRpc.TRANSFER: a batch's
    receive, a finish's reload), without spinning."""
    if method == WorkerRpc.TRANSFER.value:
        with _waiting_without_spin(self):
            return _vllm_collective_rpc(self, method, timeout, args, kwargs)
    if method != WorkerRpc.LOAD.value:
        return _vllm_collective_rpc(self, method, timeout, args, kwargs)
    generation = _generation(self)
    with _waiting_without_spin(self), generation.applying() if generation else contextlib.nullcontext():
        return _vllm_collective_rpc(self, method, timeout, args, kwargs)


# inspect.signature follows it: vLLM converts a utility's arguments by vLLM's own signature.
collective_rpc.__wrapped__ = _vllm_collective_rpc  # type: ignore[attr-defined]


@contextlib.contextmanager
def _waiting_without_spin(core: EngineCore) -> Iterator[None]:
    """While a load runs (hundreds of ms), the engine thread waits for the workers' answers
    by polling their response queues' notify socket instead of vLLM's sched_yield spin (which
    it keeps up for a second after each read). The spin holds a core that the load's
    byte-moving threads (gloo's and ZMQ's I/O, the receive thread: worker/weights/cores.py)
    and a trainer on the same host need; waking from the poll costs microseconds. Interleaved
    A/Bs: gloo 6-10%, tensor-stream 11-17%, disk 3-5% faster updates (docs/weights.md)."""
    queues: list[Any] = getattr(getattr(core, "model_executor", None), "response_mqs", None) or []
    conditions: list[Any] = [
        q._spin_condition for q in queues if hasattr(getattr(q, "_spin_condition", None), "busy_loop_s")
    ]
    saved = [c.busy_loop_s for c in conditions]
    for condition in conditions:
        condition.busy_loop_s = 0
    try:
        yield
    finally:
        for condition, busy_loop_s in zip(conditions, saved, strict=True):
            condition.busy_loop_s = busy_loop_s
