"""The disk reader: a disk update's safetensors files, mapped copy-on-write (Source.DISK).

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC (readers/__init__.py):
it maps and views every file before vLLM's reload sees a tensor; the reload, on this thread,
copies each from the page cache into the parameters.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

from enginectl.common.safetensors_header import parse_header
from enginectl.contract.engine import Cause, LoadPlan
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.groups import typed_view


class DiskReader:
    """Every file mapped and viewed before vLLM sees a tensor: a file that no longer fits its
    header fails the load with the weights untouched."""

    broken_cause = Cause.LOAD_FAILED

    def __init__(self, worker: Any, plan: LoadPlan, channel: Channel) -> None:
        self._tensors = _handed_over(list(disk_tensors(plan)))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors

    def close(self) -> None:
        pass  # a mapping goes with the last view of it


def disk_tensors(plan: LoadPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a disk update's files, in file order."""
    for file in plan.files:
        yield from mapped_safetensors(file)


def mapped_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file, in the order of their bytes: views of the file
    mapped copy-on-write, so the load copies every byte once, from the page cache into the
    parameters (docs/weights.md, "disk"). The server checked the header before planning the
    update; a file changed since raises at the tensor that no longer fits, and since a load
    lists every file's tensors before vLLM sees one, the load fails (LOAD_FAILED) with the
    weights untouched."""
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    (header_len,) = struct.unpack_from("<Q", mapping, 0)
    start = 8 + header_len
    name = os.path.basename(path)
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping while a view lives
    for entry in parse_header(mapping[8:start], name):
        if start + entry.end > data.numel():
            raise ValueError(f"{name}: tensor {entry.name!r} does not fit the file")
        yield entry.name, typed_view(data, start + entry.begin, entry.dtype, entry.shape)


def _handed_over(pairs: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` in order, each let go of once handed on: the list does not keep a tensor (and
    its file mapping) alive after vLLM loaded it."""
    pairs.reverse()
    while pairs:
        yield pairs.pop()
