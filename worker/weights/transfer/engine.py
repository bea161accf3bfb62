"""GlooWeightTransferEngine: enginectl's gloo broadcast as one of vLLM's weight-transfer engines.

Runs INSIDE every vLLM worker process. vLLM's worker builds it when the engine is served with
`--weight-transfer-config '{"backend": "gloo"}'` (vLLM's flag; `register` put it in vLLM's
`WeightTransferEngineFactory`), and calls it from its own four-step methods
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`), each on the worker's RPC thread, between forward passes: the only
thread that touches the weights (docs/architecture.md, "Processes and threads"). The joining
thread and the receiving thread move bytes only.

It is the same transport as enginectl's own broadcast updates, not a second one: the group is
joined as `INIT_GROUP` joins one (worker/weights/groups.py `start_join`: its own TCPStore and
PrefixStore, a probe broadcast), and tensors arrive through the one receive of a DISTRIBUTED
load (`received_broadcast`: buckets cut by common/buckets.py, reused receive buffers, the next
bucket received while this one loads). The trainer's side is
enginectl.client.transfer_engine (docs/weights.md, "vLLM's weight-transfer engines").

Unlike vLLM's NCCL engine, which opens vLLM's layerwise reload in `start_weight_update` and
loads each batch as it arrives, this engine touches the model once, in `finish_weight_update`:
each `update_weights` receives its batch into the group's receive buffers, and the finish
loads the whole round in one in-memory reload. Between `start` and `finish` the model holds its
old weights, whole: a forward pass there is correct (with vLLM's layerwise reload open, the
layers are meta tensors, and a step that runs then kills the engine on the CPU build), and a
round that fails before its finish leaves the weights untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from enginectl.common import dtypes, gloo_transfer
from enginectl.contract.engine import GLOO_TRANSFER_BACKEND, TensorSpec
from enginectl.contract.groups import Backend, GroupSpec
from enginectl.worker.weights.groups import Group, received_broadcast, start_join
from enginectl.worker.weights.transfer.staging_target import StagingTarget

BACKEND = GLOO_TRANSFER_BACKEND  # the name in vLLM's factory, and in --weight-transfer-config
DEFAULT_GROUP = gloo_transfer.DEFAULT_TRANSFER_GROUP
JOIN_MARGIN_S = gloo_transfer.TRANSFER_JOIN_MARGIN_S  # past the rendezvous timeout, the join thread is given up on


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What `init_weight_transfer_engine` takes (as a dict): the trainer's group, rank 0 on
    `master_address:master_port` (its TCPStore); this engine's workers take ranks
    `rank_offset`.. in global worker order. `timeout_s` bounds the rendezvous and every
    broadcast (gloo's own timeout)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    timeout_s: float = gloo_transfer.DEFAULT_TRANSFER_TIMEOUT_S
    # Set by enginectl's server, not the trainer: the global index of the first worker of the
    # ranks the server manages (contract/engine.py WorkerLayout.first_worker; 0 unless the
    # server is one of several of a hybrid load-balanced engine).
    first_worker: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address must be a host name or address")
        for name in ("master_port", "rank_offset", "world_size", "first_worker"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, not {self.master_port}")
        if self.rank_offset < 1 or self.world_size <= self.rank_offset:
            raise ValueError("rank_offset must be >= 1 (the trainer is rank 0) and below world_size")
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600], not {self.timeout_s!r}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One `update_weights` batch (as a dict): the tensors the trainer broadcasts next, in
    order, with vLLM's NCCL engine's field names; `bucket_bytes` packs tensors of at most
    that size into one broadcast (0: one broadcast per tensor), cut as the trainer cuts them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names, dtype_names and shapes must be as long: {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )
        for dtype in self.dtype_names:
            if dtype not in dtypes.BY_NAME:
                raise ValueError(f"unknown dtype {dtype!r}")
        for shape in self.shapes:
            if not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"a shape is a list of non-negative integers, not {shape!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be a non-negative integer, not {self.bucket_bytes!r}")

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(name, dtype, tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True)
        )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """vLLM's engine interface over enginectl's gloo group and receive (module docstring)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Group | None = None
        self._received: list[tuple[str, torch.Tensor]] = []  # this round's tensors, not loaded yet

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's group; returns once the probe broadcast arrived, or raises
        within the rendezvous timeout (the join thread is then given up on)."""
        if self.group is not None:
            raise RuntimeError(f"already in group {self.group.name!r}: call shutdown_weight_transfer_engine first")
        spec = GroupSpec(
            init_info.group_name,
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset,
            init_info.world_size,
            float(init_info.timeout_s),
            Backend.GLOO,
            init_info.first_worker,
        )
        rank = init_info.rank_offset + _global_rank(self.parallel_config) - init_info.first_worker
        join = start_join(spec, self.parallel_config.data_parallel_index, rank)
        outcome = join.wait(spec.timeout + JOIN_MARGIN_S)
        if not isinstance(outcome, Group):
            join.abandoned = True  # a join that ends later is let go
            message = outcome.message if outcome is not None else "the rendezvous did not end in time"
            raise TimeoutError(f"joining group {spec.name!r} as rank {rank} failed: {message}")
        self.group = outcome

    def start_weight_update(self) -> None:
        self._received = []

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive one batch into the group's receive buffers; the model is not touched."""
        if self.group is None:
            raise RuntimeError("no group: call init_weight_transfer_engine first")
        deadline = time.monotonic() + self.group.timeout
        try:
            self._received.extend(
                received_broadcast(
                    self.group, update_info.specs(), update_info.bucket_bytes, _nothing, _nothing, deadline
                )
            )
        except BaseException:
            self._received = []
            raise

    def finish_weight_update(self) -> None:
        """Apply every tensor of the round in one in-memory reload (vLLM's layerwise reload:
        on the CPU build that is what repacks the linear layers); or, when the round's target
        is a StagingTarget (`set_weight_update_target`: a stage, staging_target.py), copy
        them into the staging buffer."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        received, self._received = self._received, []
        if isinstance(self.model, StagingTarget):  # a round that stages: copied, the model untouched
            self.model.load_weights(received)
            return
        if not received:  # a round with no batch: nothing to apply (an empty reload is not a no-op)
            return
        reload_weights(self.vllm_config, self.model, received, None, is_checkpoint_format=True)

    def abort_weight_update(self) -> None:
        """Drop the round's received tensors (enginectl's ABORT step: worker/weights/transfer/steps.py)."""
        self._received = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronises the accelerator after the receive; on CPU there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.buffers.clear()  # dropping the last reference closes gloo's connections


def _nothing() -> None:
    return None


def _global_rank(parallel: Any) -> int:
    """This worker's rank across every DP rank's workers (ranks.py's, from vLLM's config)."""
    return int(parallel.data_parallel_index) * int(parallel.world_size) + int(parallel.rank)


def register() -> None:
    """Put the engine in vLLM's factory under BACKEND (lazily, by module path); idempotent.
    Called where enginectl's worker extension is built (worker/attach.py) and, as a vLLM
    general plugin, in every vLLM process of an environment enginectl is installed in."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, GlooWeightTransferEngine.__name__)
    except ValueError:  # registered already (by the plugin, or by an earlier call)
        pass
