"""The broadcast reader: an UpdateWeightsFromDistributed update's tensors, broadcast by the
trainer through an update group (Source.DISTRIBUTED; the group and its receive are
worker/weights/groups.py).

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC (readers/__init__.py);
the group's receive thread moves the broadcast bytes into the group's receive buffers, and only
the RPC thread hands them on to vLLM's reload (worker/weights/fingerprints.py, "who may touch
the weights").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from enginectl.contract.engine import Cause, LoadPlan
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.groups import broadcast_tensors


class BroadcastReader:
    """The group is looked up before vLLM sees a tensor (Abort GROUP_NOT_FOUND from the
    constructor); a receive that fails midway is the sender's: STREAM_BROKEN."""

    broken_cause = Cause.STREAM_BROKEN

    def __init__(self, worker: Any, plan: LoadPlan, channel: Channel) -> None:
        self._tensors = broadcast_tensors(worker, plan, channel)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors

    def close(self) -> None:
        pass  # the group keeps its receive buffers for the next update
