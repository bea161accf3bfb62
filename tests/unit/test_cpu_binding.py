"""The OpenMP binding enginectl chooses for vLLM's CPU workers when vLLM's own would refuse
(server/cpu_binding.py): pure arithmetic and the one environment variable, no engine.

The NUMA layout is the host's: vLLM reads it from the kernel (`get_visible_memory_node`), and
a test cannot give this machine a second node or take it away from another. So that one
function is replaced by a stand-in that names the layout each rule is about (one node; two
nodes), and nothing else is faked: the environment variable, the CPU affinity and vLLM's
platform check are the real ones. The real path on this one-node host runs end to end in
tests/e2e/test_tensor_parallel.py, which starts a TP=2 engine with no binding set and reads
the `cpu threads bind default` line it logs."""

from __future__ import annotations

import argparse
import os

import pytest

from enginectl.server.cpu_binding import BIND_ENV, split_cpus, threads_bind_default


def test_cpus_are_split_evenly_and_cover_every_worker() -> None:
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([3, 0, 1, 2, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cpus([0], 2) == [[0], [0]]  # fewer CPUs than workers: shared, never empty


def _args(tp: int, pp: int = 1, dp: int = 1) -> argparse.Namespace:
    return argparse.Namespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, data_parallel_size_local=None
    )


def test_two_workers_per_engine_on_one_numa_node_get_the_allowed_cpus_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.utils.cpu_resource_utils as cpu_resources

    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setattr(cpu_resources, "get_visible_memory_node", lambda: [0])
    chosen = threads_bind_default(_args(tp=2))
    assert chosen is not None
    expected = "|".join(",".join(map(str, cpus)) for cpus in split_cpus(sorted(os.sched_getaffinity(0)), 2))
    assert os.environ[BIND_ENV] == chosen.value == expected
    assert (chosen.workers, chosen.numa_nodes) == (2, 1)


def test_a_users_binding_and_engines_vllm_can_bind_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.utils.cpu_resource_utils as cpu_resources

    monkeypatch.setenv(BIND_ENV, "0|1")
    assert threads_bind_default(_args(tp=2)) is None and os.environ[BIND_ENV] == "0|1"
    monkeypatch.delenv(BIND_ENV)
    assert threads_bind_default(_args(tp=1, dp=2)) is None  # one worker per engine: vLLM's auto works
    monkeypatch.setattr(cpu_resources, "get_visible_memory_node", lambda: [0, 1])
    assert threads_bind_default(_args(tp=2)) is None  # a NUMA node per worker
    assert BIND_ENV not in os.environ
