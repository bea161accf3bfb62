"""The IPC reader: an UpdateWeightsFromIpc update's tensors, the trainer's own memory mapped
into this worker (Source.IPC; the mapping itself is worker/weights/ipc.py).

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC (readers/__init__.py):
that thread maps every handle before vLLM's reload sees a tensor and unmaps them all when the
load ended, before the RPC answers. No other thread touches the mappings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from enginectl.contract.engine import Cause, LoadPlan
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.ipc import IpcTensors


class IpcReader:
    """Every handle mapped before vLLM sees a tensor: a bad one changes nothing (Abort
    IPC_HANDLE_UNAVAILABLE from the constructor)."""

    broken_cause = Cause.LOAD_FAILED

    def __init__(self, worker: Any, plan: LoadPlan, channel: Channel) -> None:
        self._mapped = IpcTensors(plan, channel.slot)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._mapped.pairs)

    def close(self) -> None:
        self._mapped.close()  # the trainer owns the memory: no mapping outlives the load
