"""What enginectl attaches to vLLM's classes, and when: `attach()` (worker/attach.py) puts every
EngineCore utility of the engine contract and the wrapped `collective_rpc` on vLLM's
EngineCore, a second call changes nothing, building a worker with the extension mixed in (as
vLLM does) attaches, and importing enginectl's worker modules attaches nothing.

That the hooks reach a real engine (utilities answered, weight loads, identities) is the
subject of the end-to-end tests (tests/e2e/weight_updates/, tests/e2e/test_fpm_identity.py).
One check here runs a child process: only a fresh interpreter shows what importing alone does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.engine.core import EngineCore
from vllm.v1.worker.worker_base import WorkerBase

from enginectl.contract.engine import Utility, VllmUtility
from enginectl.worker import engine_core
from enginectl.worker.attach import ENGINE_CORE_HOOKS, attach
from enginectl.worker.weights.extension import EnginectlWorkerExtension

UTILITIES = {utility.value for utility in Utility}
COLLECTIVE_RPC = VllmUtility.COLLECTIVE_RPC.value
IMPORT_S = 300.0  # deadline of the child process (importing vLLM takes seconds)


def _enginectl_attributes() -> set[str]:
    return {name for name in dir(EngineCore) if name.startswith("enginectl")}


@pytest.fixture
def vllm_collective_rpc() -> Iterator[Callable[..., Any]]:
    """vLLM's own EngineCore.collective_rpc; EngineCore is given back as vLLM defines it after
    the test (attach() changes the class for the whole process)."""
    saved = {name: EngineCore.__dict__[name] for name in ENGINE_CORE_HOOKS if name in EngineCore.__dict__}
    own = saved[COLLECTIVE_RPC]
    assert own.__module__ == "vllm.v1.engine.core" and not hasattr(own, "__wrapped__")
    assert _enginectl_attributes() == set()  # importing this test's modules attached nothing
    yield own
    for name in ENGINE_CORE_HOOKS:
        if name in saved:
            setattr(EngineCore, name, saved[name])
        elif name in EngineCore.__dict__:
            delattr(EngineCore, name)


def _assert_attached(vllm_own: Callable[..., Any]) -> None:
    assert _enginectl_attributes() == UTILITIES
    for name, hook in ENGINE_CORE_HOOKS.items():
        assert EngineCore.__dict__[name] is hook
    wrapper = EngineCore.__dict__[COLLECTIVE_RPC]
    assert wrapper is engine_core.collective_rpc
    assert wrapper.__wrapped__ is vllm_own  # wrapped once: vLLM's own method, not a wrapper


def test_attach_installs_every_utility_and_the_wrapped_collective_rpc_once(
    vllm_collective_rpc: Callable[..., Any],
) -> None:
    attached = attach()
    assert sorted(attached) == sorted(UTILITIES | {COLLECTIVE_RPC})
    assert attached == tuple(ENGINE_CORE_HOOKS)
    _assert_attached(vllm_collective_rpc)

    assert attach() == attached  # idempotent: the same hooks, the wrapper not wrapped again
    _assert_attached(vllm_collective_rpc)


def test_building_a_worker_with_the_extension_mixed_in_attaches(vllm_collective_rpc: Callable[..., Any]) -> None:
    class Worker(WorkerBase):
        def __init__(self, **kwargs: Any) -> None:  # vLLM's needs a whole engine config
            pass

    # As vLLM's WorkerWrapperBase.init_worker mixes in `worker_extension_cls`, then builds it.
    Worker.__bases__ = Worker.__bases__ + (EnginectlWorkerExtension,)
    worker = Worker(rank=0)
    assert isinstance(worker, EnginectlWorkerExtension)
    _assert_attached(vllm_collective_rpc)


IMPORT_EVERY_WORKER_MODULE = """
import importlib, json, pkgutil
import enginectl.worker
from vllm.v1.engine.core import EngineCore
modules = [m.name for m in pkgutil.walk_packages(enginectl.worker.__path__, "enginectl.worker.")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({
    "modules": modules,
    "enginectl": sorted(n for n in dir(EngineCore) if n.startswith("enginectl")),
    "generation_state": hasattr(EngineCore, "enginectl_generation_state"),
    "collective_rpc_wrapped": hasattr(EngineCore.collective_rpc, "__wrapped__"),
}))
"""


def test_importing_the_worker_modules_attaches_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_WORKER_MODULE], capture_output=True, text=True, timeout=IMPORT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert {
        "enginectl.worker.attach",
        "enginectl.worker.scheduler",
        "enginectl.worker.fpm.scheduler",
        "enginectl.worker.weights.extension",
    } <= set(seen["modules"])
    assert seen["enginectl"] == []
    assert seen["generation_state"] is False
    assert seen["collective_rpc_wrapped"] is False
