"""Where a vLLM worker sits: its data-parallel rank, its rank among that rank's workers, and
its index among all workers (contract/engine.py `WorkerLayout`).

Runs inside a vLLM worker process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerPlace:
    """A worker's place in the engine: what its update channel and its reports are keyed by."""

    dp_rank: int
    worker_rank: int  # among its DP rank's workers (TP x PP): vLLM's `worker.rank`
    index: int  # among all workers of all DP ranks: WorkerLayout.index(dp_rank, worker_rank)


def dp_rank(worker: Any) -> int:
    """The DP rank of the EngineCore this worker belongs to."""
    parallel = worker.vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)


def global_rank(worker: Any) -> int:
    """This worker's index among all workers of all DP ranks."""
    return dp_rank(worker) * int(worker.vllm_config.parallel_config.world_size) + int(worker.rank)


def place(worker: Any) -> WorkerPlace:
    """Where `worker` sits (see WorkerPlace)."""
    return WorkerPlace(dp_rank(worker), int(worker.rank), global_rank(worker))
