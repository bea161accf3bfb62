"""Where vLLM's CPU workers run their OpenMP threads, when the user said nothing and vLLM's own
choice would refuse to start.

Runs in the `enginectl serve` process, before the engine starts (server/serve.py). vLLM's CPU
build binds each worker's threads to CPUs: by default (`VLLM_CPU_OMP_THREADS_BIND=auto`) one
NUMA node per worker of an engine, and it refuses to start an engine with more workers
(tensor x pipeline parallel) than the visible NUMA nodes ("Not enough allowed NUMA nodes to
bind threads of 2 local CPUWorkers"). A one-node host, the common case, could then never run
`--tensor-parallel-size 2`. Where vLLM would refuse and the variable is unset, this splits the
CPUs the process may use evenly between the host's local workers, in vLLM's own format
(one list per local worker, `|`-separated, in [DP, PP, TP] order), and says so in one log line;
a user's own value is never touched (docs/operations.md, "Tensor parallelism on the CPU build").
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class ThreadsBind:
    """The CPU lists chosen for a start that named none: one per local worker."""

    value: str  # what VLLM_CPU_OMP_THREADS_BIND was set to
    workers: int
    numa_nodes: int

    def describe(self) -> dict[str, Any]:
        """The fields of the one log line that announces it (server/serve.py)."""
        return {
            "env": BIND_ENV,
            "value": self.value,
            "workers": self.workers,
            "numa_nodes": self.numa_nodes,
            "rule": "vLLM's auto binding needs a NUMA node per worker of an engine: the allowed CPUs split evenly",
            "override": f"{BIND_ENV}=LIST|LIST|... (one per local worker), auto or nobind",
        }


def split_cpus(cpus: list[int], workers: int) -> list[list[int]]:
    """`cpus` cut into `workers` contiguous, nearly equal lists; with fewer CPUs than workers,
    workers share them round-robin (each list holds one CPU)."""
    cpus = sorted(cpus)
    if len(cpus) < workers:
        return [[cpus[i % len(cpus)]] for i in range(workers)]
    size, extra = divmod(len(cpus), workers)
    lists, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        lists.append(cpus[start:end])
        start = end
    return lists


def threads_bind_default(args: argparse.Namespace) -> ThreadsBind | None:
    """On vLLM's CPU build, with VLLM_CPU_OMP_THREADS_BIND unset (vLLM's `auto`) and more
    workers per engine than visible NUMA nodes: set it to the allowed CPUs split between the
    local workers, and return what was chosen. None when nothing was set."""
    if os.environ.get(BIND_ENV, ""):
        return None
    workers_per_engine = int(args.tensor_parallel_size) * int(args.pipeline_parallel_size)
    if workers_per_engine < 2:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import vllm.utils.cpu_resource_utils as cpu_resources

    nodes = len(cpu_resources.get_visible_memory_node())
    if nodes >= workers_per_engine:
        return None  # vLLM's auto binding gives each worker a node of its own
    dp_local = int(getattr(args, "data_parallel_size_local", None) or args.data_parallel_size)
    workers = dp_local * workers_per_engine
    lists = split_cpus(sorted(os.sched_getaffinity(0)), workers)
    value = "|".join(",".join(str(c) for c in cpus) for cpus in lists)
    os.environ[BIND_ENV] = value
    return ThreadsBind(value, workers, nodes)
