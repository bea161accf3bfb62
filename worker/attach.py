"""`attach()`: the one call that puts enginectl's hooks on vLLM's classes.

Runs in each EngineCore process and in each worker process. Importing any enginectl module
changes nothing in vLLM; the hooks exist once `attach()` ran, and it is called explicitly:

- by enginectl's scheduler factory (worker/scheduler.py) when the EngineCore builds it, in the
  EngineCore process, before the EngineCore answers any utility call;
- by enginectl's worker extension (worker/weights/extension.py) when vLLM builds the worker it
  is mixed into, in the worker's process, before any RPC. On single-worker engines the worker
  runs in the EngineCore process, so the utilities exist there under another scheduler too.

What it attaches is `ENGINE_CORE_HOOKS`: every enginectl EngineCore utility of the engine
contract (contract/engine.py `Utility`), and enginectl's wrapper of vLLM's `collective_rpc`
(worker/engine_core.py), whose `__wrapped__` is vLLM's own method. Attaching again changes
nothing: the same functions are set again, and the wrapper never wraps itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from vllm.v1.engine.core import EngineCore

from enginectl.contract.engine import Utility, VllmUtility
from enginectl.worker import engine_core
from enginectl.worker.fpm import engine_core as identity_core

# Attribute of vLLM's EngineCore -> what attach() sets it to.
ENGINE_CORE_HOOKS: Final[Mapping[str, Callable[..., Any]]] = MappingProxyType(
    {
        Utility.GENERATION_STATE.value: engine_core.enginectl_generation_state,
        Utility.PAUSE.value: engine_core.enginectl_pause,
        Utility.RESUME.value: engine_core.enginectl_resume,
        Utility.HOLD.value: engine_core.enginectl_hold,
        Utility.FINISH_UPDATE.value: engine_core.enginectl_finish_update,
        Utility.WORKER_CALL.value: engine_core.enginectl_worker_call,
        Utility.CENSUS.value: engine_core.enginectl_census,
        Utility.CONFIGURE.value: identity_core.configure,
        Utility.SET_WORKER_IDENTITY.value: identity_core.set_worker_identity,
        Utility.GET_WORKER_IDENTITY.value: identity_core.get_worker_identity,
        VllmUtility.COLLECTIVE_RPC.value: engine_core.collective_rpc,
    }
)

# Every utility of the contract has its hook here (the server calls them all by name).
_missing = [utility.value for utility in Utility if utility.value not in ENGINE_CORE_HOOKS]
assert not _missing, f"EngineCore utilities without a hook: {_missing}"


def attach() -> tuple[str, ...]:
    """Set every hook of ENGINE_CORE_HOOKS on vLLM's EngineCore class; idempotent. Answers
    the names attached, in order."""
    for name, hook in ENGINE_CORE_HOOKS.items():
        setattr(EngineCore, name, hook)
    return tuple(ENGINE_CORE_HOOKS)
