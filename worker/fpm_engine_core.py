"""Worker-identity utilities of vLLM's EngineCore, attached to the class at import.

Runs inside each EngineCore process (imported by fpm_scheduler.py, which the EngineCore
loads as its scheduler). The `enginectl serve` process calls them on every rank with
`call_utility` (see server/fpm_identity.py); they run on the engine thread, between steps.
Each returns the rank's resulting identity as a plain dict (msgpack-able):
`{"dp_rank": int, "worker_id": str, "identity_generation": int}`.

An EngineCore that runs another scheduler has no identity: the utilities raise, and the
server reports that rank as failed.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import EngineCore

from enginectl.worker.fpm_identity import GET_IDENTITY_UTILITY, SET_IDENTITY_UTILITY


def _fpm_scheduler(core: EngineCore) -> Any:
    scheduler = core.scheduler
    if getattr(scheduler, "fpm_identity", None) is None:
        raise RuntimeError(
            f"this EngineCore runs {type(scheduler).__name__}, not enginectl's scheduler: "
            "it has no worker identity"
        )
    return scheduler


def _answer(scheduler: Any) -> dict[str, Any]:
    state = scheduler.fpm_identity.current
    return {"dp_rank": scheduler.fpm_dp_rank, "worker_id": state.worker_id,
            "identity_generation": state.generation}


def enginectl_set_worker_identity(self: EngineCore, worker_id: str, generation: int) -> dict[str, Any]:
    """Make this rank stamp `worker_id` at `generation` on every sample it makes from now on
    (steps and heartbeats alike). `generation` must be above the held one, unless the rank
    already holds exactly this identity (then nothing changes)."""
    scheduler = _fpm_scheduler(self)
    scheduler.fpm_identity.set(str(worker_id), int(generation))
    return _answer(scheduler)


def enginectl_get_worker_identity(self: EngineCore) -> dict[str, Any]:
    """The identity this rank holds now."""
    return _answer(_fpm_scheduler(self))


setattr(EngineCore, SET_IDENTITY_UTILITY, enginectl_set_worker_identity)
setattr(EngineCore, GET_IDENTITY_UTILITY, enginectl_get_worker_identity)
