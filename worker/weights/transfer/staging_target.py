"""StagingTarget: where a staged transfer round's engine writes (vLLM's weight-update target).

Runs inside every vLLM worker process. vLLM's weight-transfer engines write into
`engine.model`, which `set_weight_update_target(model, model_config)` points elsewhere for one
round (vLLM does it for a draft model) and `reset_weight_update_target` points back. A round
started with `stage_only` (server/weights/transfer.py) points it at a StagingTarget: the
engine's `load_weights(weights)` copies each tensor into this worker's staging buffer (the one
two-phase updates keep and reuse: worker/weights/staging.py), the model is never touched, and
generation goes on between the round's steps. After the engine's finish, `complete` makes the
buffer this worker's staged set, digested like every staged set; CommitStagedWeights then
loads it as any commit does.

Threads: every call comes from the worker's RPC thread, inside one TRANSFER step (the
engine's `finish_weight_update` for enginectl's `gloo` engine, which delivers the round at
once), between forward passes; the buffer is written by nobody else while the round is open
(no staging thread runs: the server keeps one set, and a stage holds the one update slot).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from enginectl.common import dtypes
from enginectl.contract.engine import Cause, LoadError, Source, StageResult, TensorSpec
from enginectl.worker.weights.staging import Staged, StagingState, completed


class StagingTarget(torch.nn.Module):
    """A model stand-in that stages what is loaded into it (module docstring)."""

    def __init__(self, state: StagingState, token: str, dp_rank: int, worker_rank: int) -> None:
        super().__init__()
        self._state = state
        self.token = token
        self._rank = (dp_rank, worker_rank)
        self._specs: list[TensorSpec] = []
        self._offsets: list[int] = []
        self._names: set[str] = set()
        self._size = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy every tensor, in order, after the ones staged so far (vLLM's engines call this
        as they would the model's); the names loaded, as vLLM's models answer."""
        items = list(weights)
        specs = []
        for name, tensor in items:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if name in self._names or dtype not in dtypes.BY_NAME:
                raise ValueError(f"{name}: staged twice in one round, or of a dtype staging can not hold ({dtype})")
            self._names.add(name)
            specs.append(TensorSpec(name, dtype, tuple(int(n) for n in tensor.shape)))
        buffer = self._room(self._size + sum(dtypes.nbytes(s.dtype, s.shape) for s in specs))
        for spec, (_, tensor) in zip(specs, items, strict=True):
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
            np.copyto(buffer.numpy()[self._size : self._size + data.numel()], data.numpy())
            self._specs.append(spec)
            self._offsets.append(self._size)
            self._size += data.numel()
        return {spec.name for spec in specs}

    def _room(self, size: int) -> torch.Tensor:
        """The staging buffer, grown to `size` bytes (what was staged so far kept)."""
        state = self._state
        if state.buffer is None or state.buffer.numel() < size:
            grown = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if state.buffer is not None and self._size:
                grown[: self._size].copy_(state.buffer[: self._size])
            state.buffer = grown
        return state.buffer

    def complete(self) -> StageResult:
        """The round finished: what was loaded becomes this worker's staged set (digested,
        with the typed views a commit loads), answered as its StageResult."""
        rank, worker = self._rank
        buffer = self._state.buffer if self._state.buffer is not None else torch.empty(0, dtype=torch.uint8)
        staged = Staged(self.token, Source.STAGED, tuple(self._specs), self._offsets, buffer[: self._size])
        if not self._specs:
            staged.result = StageResult(
                rank, worker, done=True, error=LoadError(Cause.LOAD_FAILED, "the round sent no tensor to stage")
            )
        else:
            staged.result = completed(staged, rank, worker)
        self._state.current = staged
        return staged.result
