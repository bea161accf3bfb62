"""Generation-state utility of vLLM's EngineCore, attached to the class at import.

Runs inside each EngineCore process: imported by enginectl's scheduler module (fpm_scheduler)
and by the weight worker extension (worker in the EngineCore process on single-worker
engines). The `enginectl serve` process calls it on every rank (EngineAdapter.call_all).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import EngineCore

GENERATION_STATE_UTILITY = "enginectl_generation_state"


def enginectl_generation_state(self: EngineCore) -> dict[str, Any]:
    """This rank's pause state and request counts, between two steps."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler: Any = self.scheduler
    parallel = self.vllm_config.parallel_config
    return {
        "dp_rank": int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0),
        "paused": getattr(scheduler, "pause_state", PauseState.UNPAUSED) != PauseState.UNPAUSED,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
    }


setattr(EngineCore, GENERATION_STATE_UTILITY, enginectl_generation_state)
