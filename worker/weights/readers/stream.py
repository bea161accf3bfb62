"""The tensor-stream reader: UpdateWeightsFromTensors chunks into a reused receive buffer
(Source.TENSORS).

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC (readers/__init__.py):
the chunks arrive on the update's data channel (worker/weights/channel.py) and are received on
that thread, between the tensors vLLM's reload loads; each tensor is handed on as soon as its
last byte arrived.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from enginectl.common import dtypes
from enginectl.contract.engine import Cause, LoadPlan, TensorSpec
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.groups import aligned, typed_view


class StreamReader:
    """Tensors from stream chunks, each yielded as soon as its last byte arrived. Every view
    of the reused receive buffer is made here, before vLLM's reload runs (inside it each torch
    call costs several times more); a tensor that a 1-byte tensor of odd size left unaligned
    is copied once it arrived instead (None until then)."""

    broken_cause = Cause.LOAD_FAILED

    def __init__(self, worker: Any, plan: LoadPlan, channel: Channel) -> None:
        specs = plan.tensors
        buffer = _reusable_buffer(worker, sum(_nbytes(spec) for spec in specs))
        views: list[torch.Tensor | None] = []
        ends: list[int] = []
        start = 0
        for spec in specs:
            views.append(typed_view(buffer, start, spec.dtype, spec.shape) if aligned(start, spec.dtype) else None)
            start += _nbytes(spec)
            ends.append(start)
        self._tensors = _streamed(specs, buffer, views, ends, channel)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors

    def close(self) -> None:
        pass  # the receive buffer is kept for the next update


def _streamed(
    specs: tuple[TensorSpec, ...],
    buffer: torch.Tensor,
    views: list[torch.Tensor | None],
    ends: list[int],
    channel: Channel,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `specs` (`views` of `buffer`, ending at `ends`) as the chunks fill it."""
    received_view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    index = 0
    while index < len(specs):
        chunk = channel.recv()  # an abort raises: short streams end that way
        received_view[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        received = chunk.offset + len(chunk.data)
        while index < len(specs) and ends[index] <= received:
            spec, tensor = specs[index], views[index]
            if tensor is None:
                tensor = typed_view(buffer, ends[index] - _nbytes(spec), spec.dtype, spec.shape)
            index += 1
            yield spec.name, tensor


def _nbytes(spec: TensorSpec) -> int:
    return dtypes.nbytes(spec.dtype, spec.shape)


def _reusable_buffer(worker: Any, size: int) -> torch.Tensor:
    """A uint8 receive buffer of `size` bytes, reused across updates when it fits."""
    buffer = getattr(worker, "_enginectl_stream_buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.uint8)
        worker._enginectl_stream_buffer = buffer
    return buffer[:size]
