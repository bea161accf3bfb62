"""enginectl's vLLM scheduler: vLLM's own scheduler plus a forward-pass metrics publisher.

Runs inside each EngineCore process (one per data-parallel rank). `fpm_scheduler` builds a
subclass of exactly the scheduler vLLM would otherwise use (`AsyncScheduler` when async
scheduling is on, `Scheduler` otherwise), so scheduling itself is unchanged. The EngineCore
reaches it through worker/scheduler.py `make_scheduler`, vLLM's `scheduler_cls` under
`enginectl serve`, which first attaches enginectl's EngineCore utilities (worker/attach.py).
Importing this module changes nothing in vLLM.

The scheduler holds the rank's RankGeneration (generation.py): every pause and resume, vLLM's
own included, goes through `set_pause_state`, which tells it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from enginectl.contract.engine_config import EngineConfig
from enginectl.worker.fpm.generation import RankGeneration
from enginectl.worker.fpm.identity import WorkerIdentity
from enginectl.worker.fpm.load import queued_load, scheduled_load
from enginectl.worker.fpm.publisher import FpmPublisher, PublisherConfig

# After the head is lost: how long vLLM's own shutdown may take before the process exits.
STOP_GRACE_S = 5.0
HEAD_LOST_EXIT_CODE = 1

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from enginectl.worker.fpm.load import ScheduledLoad


class FpmScheduler(Scheduler):
    """vLLM's Scheduler that also times every step, computes its metrics from its own state
    and hands them to the rank's FpmPublisher. Holds the rank's one WorkerIdentity and its one
    RankGeneration."""

    fpm_identity: WorkerIdentity
    fpm_generation: RankGeneration
    fpm_dp_rank: int
    fpm_publisher: FpmPublisher | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.fpm_generation = RankGeneration()  # before vLLM's init, which may set a pause state
        super().__init__(*args, **kwargs)
        engine_config = EngineConfig.load(self.vllm_config.additional_config)
        self.fpm_identity = WorkerIdentity(engine_config.worker_id)
        self.fpm_dp_rank = int(self.vllm_config.parallel_config.data_parallel_index)
        # Scheduled outputs whose model output is not processed yet (the batch queue may hold
        # two): id -> (output, start, its metrics or None when empty). The output is kept so
        # its id cannot be reused while pending.
        self._fpm_pending: dict[int, tuple[SchedulerOutput, float, ScheduledLoad | None]] = {}
        self.fpm_publisher = None
        self.fpm_config = engine_config
        self._fpm_publish(engine_config)

    def _fpm_publish(self, engine_config: EngineConfig) -> None:
        """Publish as `engine_config` says from now on (nothing without a relay endpoint)."""
        config = PublisherConfig.from_engine_config(engine_config)
        self.fpm_publisher = None
        if config.endpoint:
            self.fpm_publisher = FpmPublisher(
                config,
                dp_rank=self.fpm_dp_rank,
                identity=self.fpm_identity,
                activity=self._fpm_activity,
                generation=self.fpm_generation,
                head_lost=_stop_this_engine_core,
            ).start()
            self.fpm_generation.on_change = self.fpm_publisher.state_changed

    def fpm_configure(self, engine_config: EngineConfig) -> EngineConfig:
        """Hold `engine_config` (the head's CONFIGURE, on the engine thread: no step runs
        meanwhile) from now on, keeping this node's own `headless`; answers what is held. The
        same config again changes nothing (a local rank got it at start); another one replaces
        the publisher, and a worker id it names becomes this rank's identity unless one was set
        since the start (SetWorkerIdentity's generations only grow)."""
        engine_config = engine_config.sent_to(self.fpm_config)
        if engine_config.digest() == self.fpm_config.digest():
            return self.fpm_config
        if engine_config.worker_id and self.fpm_identity.current.generation == 0:
            self.fpm_identity.set(engine_config.worker_id, 1)
        previous = self.fpm_publisher
        self.fpm_generation.on_change = None
        self.fpm_config = engine_config
        self._fpm_publish(engine_config)
        if previous is not None:
            previous.close()
        return engine_config

    def _fpm_activity(self) -> tuple[int, int, int]:
        """(steps in flight, running, waiting), read by the heartbeat thread: lengths only,
        each a single atomic read."""
        running, waiting = self.get_request_counts()
        return len(self._fpm_pending), running, waiting

    def set_pause_state(self, pause_state: PauseState) -> None:
        super().set_pause_state(pause_state)
        self.fpm_generation.scheduler_paused(pause_state != PauseState.UNPAUSED)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        if self.fpm_publisher is not None:
            load = (
                scheduled_load(output.num_scheduled_tokens, self.requests)
                if output.total_num_scheduled_tokens > 0
                else None
            )
            self._fpm_pending[id(output)] = (output, start, load)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        pending = self._fpm_pending.pop(id(scheduler_output), None)
        if pending is not None and self.fpm_publisher is not None:
            _, start, load = pending
            # The same queues as get_request_counts(), read once.
            queued = queued_load(self.waiting, self.kv_holding_waiting)
            self.fpm_publisher.step_finished(  # positional: this runs every step
                time.perf_counter() - start,
                load,
                queued,
                self.get_kv_cache_usage(),
                len(self.running),
                queued.num_prefill_requests + queued.num_decode_requests,
            )
        return outputs

    def shutdown(self) -> None:
        if self.fpm_publisher is not None:
            self.fpm_publisher.close()
        super().shutdown()


def _stop_this_engine_core(why: str) -> None:
    """The head is gone (a headless node's rank; worker/fpm/publisher.py): stop this
    EngineCore as a SIGTERM does (vLLM's handler ends its busy loop and shuts it down), and
    exit at once if that has not happened within STOP_GRACE_S. Its node's process
    (server/headless.py) sees an EngineCore end, stops the others and exits non-zero."""
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(STOP_GRACE_S, os._exit, args=(HEAD_LOST_EXIT_CODE,)).start()


class FpmAsyncScheduler(FpmScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler with FpmScheduler's additions (MRO: FpmScheduler, then
    AsyncScheduler, then Scheduler)."""


def fpm_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """The FPM variant of the scheduler vLLM would pick for this config (see
    SchedulerConfig.get_scheduler_cls), built with vLLM's scheduler arguments."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    cls = FpmAsyncScheduler if vllm_config.scheduler_config.async_scheduling else FpmScheduler
    return cls(*args, **kwargs)
