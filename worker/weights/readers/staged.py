"""The staged reader: a commit's tensors, views of the staging buffer a stage filled earlier
(Source.STAGED; staging itself is worker/weights/staging.py).

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC (readers/__init__.py),
while generation is paused; no staging thread writes the buffer then (a commit loads only a
complete set).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from enginectl.contract.engine import Cause, LoadPlan
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.staging import staged_tensors, staging_state


class StagedReader:
    """The staged set `plan.stage_token`, looked up as the load starts (Abort before the first
    tensor when this worker has no complete set of that name)."""

    broken_cause = Cause.LOAD_FAILED

    def __init__(self, worker: Any, plan: LoadPlan, channel: Channel) -> None:
        self._state = staging_state(worker)
        self._token = plan.stage_token

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return staged_tensors(self._state, self._token)

    def close(self) -> None:
        """After loading from the staging buffer: the next stage checks, before it reuses the
        buffer, that the model kept no view of it (staging.py `release_if_kept`); not here,
        where generation is still paused."""
        self._state.committed = True
