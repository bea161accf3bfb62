"""How a worker reads a checkpoint from disk (worker/weights/readers/disk.py), without a server:
views of the file mapped copy-on-write, in the order of the bytes. Disk updates on a real
engine are in tests/e2e/weight_updates/test_weight_update.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def test_disk_files_are_read_as_views_of_the_mapped_file(tmp_path: Path) -> None:
    """A worker reads a safetensors file as views of the file mapped copy-on-write, in the
    order of the bytes: byte for byte the tensors written, also where a 1-byte tensor of odd
    length leaves the next one unaligned (copied then); a header whose tensor does not fit
    the file is refused at that tensor (the load fails, LOAD_FAILED)."""
    import torch

    from enginectl.worker.weights.readers.disk import mapped_safetensors

    tensors = {
        "z.odd": torch.arange(5, dtype=torch.uint8),
        "a.weight": torch.randn(3, 7),
        "m.mask": torch.tensor([True, False, True]),
        "b.half": torch.randn(2, 3).to(torch.bfloat16),
        "c.index": torch.arange(6, dtype=torch.int64).reshape(3, 2),
    }
    codes = {torch.uint8: "U8", torch.float32: "F32", torch.bool: "BOOL", torch.bfloat16: "BF16", torch.int64: "I64"}
    path = _write_safetensors(tmp_path / "mixed.safetensors", tensors, codes)
    read = list(mapped_safetensors(str(path)))
    assert [name for name, _ in read] == list(tensors)  # the order of the bytes, not of the names
    for name, tensor in read:
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name

    short = tmp_path / "short.safetensors"
    short.write_bytes(path.read_bytes()[:-8])  # the last tensor loses a byte of its 48
    names = []
    with pytest.raises(ValueError, match="c.index"):
        for name, _ in mapped_safetensors(str(short)):
            names.append(name)
    assert names == list(tensors)[:-1]


def _write_safetensors(path: Path, tensors: dict[str, Any], codes: dict[Any, str]) -> Path:
    """A safetensors file with `tensors` laid out in the dict's order, unpadded."""
    import torch

    header: dict[str, Any] = {}
    payload = b""
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        offsets = [len(payload), len(payload) + len(raw)]
        header[name] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape), "data_offsets": offsets}
        payload += raw
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + payload)
    return path
