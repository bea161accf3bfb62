"""EngineInfo: what an engine is, fixed at start, as the control plane reads it from vLLM's
config, and which of its data-parallel ranks this server manages (docs/multinode.md, "One
server per node"). Pure: no vLLM import, safe to read from any thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from enginectl.contract.engine import WorkerLayout


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is, fixed at start (safe to read from any thread)."""

    model: str
    served_model_names: tuple[str, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    quantization: str
    data_parallel_size: int  # the engine's, over every server of it
    tensor_parallel_size: int
    pipeline_parallel_size: int
    vllm_version: str
    # The DP ranks this server manages: all of them, or under hybrid / external load balancing
    # the node's own (`managed_ranks`; docs/multinode.md, "One server per node").
    managed_ranks: range = range(0)
    # Equal on every server of one hybrid load-balanced engine (a hash of its head's
    # `--data-parallel-address` and `--data-parallel-rpc-port`, which all of them are given);
    # "" for a server that manages every rank (its incarnation then names its engine).
    engine_id: str = ""

    def __post_init__(self) -> None:
        if not self.managed_ranks:  # not given: every rank
            object.__setattr__(self, "managed_ranks", range(self.data_parallel_size))

    @property
    def num_workers(self) -> int:
        """The workers of the ranks this server manages."""
        return len(self.managed_ranks) * self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def layout(self) -> WorkerLayout:
        """The managed DP ranks and the workers of each (TP x PP): what an update's channels
        address."""
        ranks = self.managed_ranks
        return WorkerLayout(len(ranks), self.tensor_parallel_size * self.pipeline_parallel_size, ranks.start)


def shared_engine_id(parallel: Any) -> str:
    """EngineInfo.engine_id: for a server that manages only some of its engine's ranks, what
    every server of that engine computes alike; "" otherwise."""
    if len(managed_ranks(parallel)) == int(parallel.data_parallel_size):
        return ""
    head = f"{parallel.data_parallel_master_ip}:{parallel.data_parallel_rpc_port}"
    return hashlib.sha256(head.encode()).hexdigest()[:16]


def managed_ranks(parallel: Any) -> range:
    """The DP ranks an API server of this vLLM parallel config manages, as vLLM's engine client
    counts them (`MPClient.engine_ranks_managed`): every rank, or under hybrid or external load
    balancing (`local_engines_only`) the node's `--data-parallel-size-local` ranks from its
    `--data-parallel-start-rank`."""
    size = int(parallel.data_parallel_size)
    if not parallel.local_engines_only:
        return range(size)
    start = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)
    count = 1 if parallel.data_parallel_external_lb else int(parallel.data_parallel_size_local)
    if not (0 <= start and count > 0 and start + count <= size):
        raise ValueError(f"ranks {start}..{start + count - 1} are not within the engine's {size} DP ranks")
    return range(start, start + count)
