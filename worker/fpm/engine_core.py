"""Worker-identity utilities of vLLM's EngineCore.

Runs inside each EngineCore process, on the engine thread, between steps. Importing this module
changes nothing in vLLM: `attach()` (worker/attach.py, called by enginectl's scheduler) puts
these functions on vLLM's EngineCore class. The `enginectl serve` process calls them on every
rank by their names in the engine contract (Utility.SET_WORKER_IDENTITY,
Utility.GET_WORKER_IDENTITY in contract/engine.py; server/engine.py makes the calls). Each
returns the rank's resulting identity, a RankIdentity in wire form.

An EngineCore that runs another scheduler has no identity: the utilities raise, and the
server reports that rank as failed.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import EngineCore

from enginectl.contract.census import RankConfigured
from enginectl.contract.engine import RankIdentity, read, wire
from enginectl.contract.engine_config import EngineConfig


def _fpm_scheduler(core: EngineCore) -> Any:
    scheduler = core.scheduler
    if getattr(scheduler, "fpm_identity", None) is None:
        raise RuntimeError(
            f"this EngineCore runs {type(scheduler).__name__}, not enginectl's scheduler: it has no worker identity"
        )
    return scheduler


def _answer(scheduler: Any) -> Any:
    state = scheduler.fpm_identity.current
    return wire(
        RankIdentity(dp_rank=scheduler.fpm_dp_rank, worker_id=state.worker_id, identity_generation=state.generation)
    )


def set_worker_identity(self: EngineCore, worker_id: str, generation: int) -> Any:
    """Make this rank stamp `worker_id` at `generation` on every sample it makes from now on
    (steps and heartbeats alike). `generation` must be above the held one, unless the rank
    already holds exactly this identity (then nothing changes)."""
    scheduler = _fpm_scheduler(self)
    scheduler.fpm_identity.set(str(worker_id), int(generation))
    return _answer(scheduler)


def get_worker_identity(self: EngineCore) -> Any:
    """The identity this rank holds now."""
    return _answer(_fpm_scheduler(self))


def configure(self: EngineCore, config_wire: Any) -> Any:
    """This start's EngineConfig, sent by the head to every rank once the census is in
    (contract/engine_config.py): a rank on another node learns the relay's endpoint, the
    channel secret and the worker id only this way. Answers a RankConfigured."""
    scheduler = _fpm_scheduler(self)
    held = scheduler.fpm_configure(read(EngineConfig, config_wire))
    publisher = scheduler.fpm_publisher
    return wire(
        RankConfigured(
            dp_rank=scheduler.fpm_dp_rank,
            digest=held.digest(),
            fpm_endpoint=publisher.config.endpoint if publisher is not None else "",
        )
    )
