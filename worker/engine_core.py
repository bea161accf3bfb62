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


def enginectl_finish_update(self: EngineCore, reset_cache: bool, fingerprint_token: str, version: str | None,
                            resume: bool) -> dict[str, Any]:
    """The end of a successful weight update in one round trip instead of four: reset the
    prefix cache, fingerprint the weights (workers keep the full one under the token), stamp
    `version` on outputs, resume. Returns the workers' fingerprints ([] without a token)."""
    if reset_cache:
        # Running requests (kept by a KEEP pause) hold blocks computed with the old weights: a
        # reset that spares them fails quietly and new requests would reuse that KV. Preempt
        # them as vLLM's own pause(clear_cache) does; they recompute with the new weights.
        if not self.reset_prefix_cache(True, False):
            raise RuntimeError("the prefix cache could not be reset")
    fingerprints = (self.collective_rpc("enginectl_declare_fingerprint", None, (fingerprint_token,), None)
                    if fingerprint_token else [])
    if version is not None:
        self.set_weight_version(version)
    if resume:
        self.resume_scheduler()
    return {"fingerprints": fingerprints}


setattr(EngineCore, GENERATION_STATE_UTILITY, enginectl_generation_state)
FINISH_UPDATE_UTILITY = "enginectl_finish_update"
setattr(EngineCore, FINISH_UPDATE_UTILITY, enginectl_finish_update)
