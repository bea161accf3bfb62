"""Where a vLLM worker sits: its data-parallel rank and its index among all workers."""

from __future__ import annotations

from typing import Any


def dp_rank(worker: Any) -> int:
    """The DP rank of the EngineCore this worker belongs to."""
    parallel = worker.vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)


def global_rank(worker: Any) -> int:
    """This worker's index among all workers of all DP ranks."""
    return dp_rank(worker) * int(worker.vllm_config.parallel_config.world_size) + int(worker.rank)
