"""Files for UpdateWeightsFromDisk to find in tests/e2e/test_fuzz.py: good ones (the model's own
values, whole or in part), bad ones (wrong dtype or shape, broken headers, symlinks out of
the allowed root, FIFOs, devices), and paths inside the allowed root and out."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from enginectl.weights.v1 import weight_update_service_pb2 as upb

# --- the server and the files it may load ---------------------------------------------------


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file: name -> (dtype code, shape, raw bytes)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(d for _, _, d in tensors.values()))


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: (e["dtype"], e["shape"], blob[base + e["data_offsets"][0] : base + e["data_offsets"][1]])
        for name, e in header.items()
    }


DTYPE_CODES = {"F32": upb.TENSOR_DTYPE_FLOAT32, "F16": upb.TENSOR_DTYPE_FLOAT16, "BF16": upb.TENSOR_DTYPE_BFLOAT16}


def make_fodder(root: Path, model: Path) -> tuple[list[str], list[str]]:
    """Good and bad things for UpdateWeightsFromDisk to find under the allowed `root`: the
    paths to fuzz with (inside the root and out), and those that load (the model's values)."""
    checkpoint = model / "model.safetensors"
    tensors = read_safetensors(checkpoint)
    norms = {k: v for k, v in tensors.items() if k.endswith("norm.weight")}
    (root / "good").mkdir()
    shutil.copy(checkpoint, root / "good" / "model.safetensors")
    (root / "subset").mkdir()
    _safetensors(root / "subset" / "model.safetensors", norms)  # the same values: loads, changes nothing
    _safetensors(
        root / "f16.safetensors",
        {  # floats are cast on load
            k: ("F16", shape, np.frombuffer(data, "<f4").astype("<f2").tobytes())
            for k, (_, shape, data) in norms.items()
        },
    )
    _safetensors(root / "int.safetensors", {k: ("I32", s, d) for k, (_, s, d) in norms.items()})
    _safetensors(root / "unknown.safetensors", {"no.such.weight": ("F32", [2], b"\x00" * 8)})
    name, (dtype, shape, data) = next(iter(norms.items()))
    _safetensors(root / "shape.safetensors", {name: (dtype, [shape[0] // 2], data[: len(data) // 2])})
    (root / "index").mkdir()
    shutil.copy(root / "subset" / "model.safetensors", root / "index" / "part.safetensors")
    (root / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "part.safetensors" for k in norms}})
    )
    (root / "badindex").mkdir()
    (root / "badindex" / "up.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "../good/model.safetensors"}})
    )
    (root / "badindex" / "missing.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "gone.safetensors"}})
    )
    (root / "badindex" / "broken.safetensors.index.json").write_text("{")
    (root / "empty.safetensors").write_bytes(b"")
    (root / "truncated.safetensors").write_bytes(checkpoint.read_bytes()[:1000])
    (root / "garbage.safetensors").write_bytes(struct.pack("<Q", 5) + b"{]}[x")
    (root / "hugeheader.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    (root / "list.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    (root / "notensor.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (root / "offsets.safetensors").write_bytes(
        struct.pack("<Q", 60)
        + json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 9999]}}).encode().ljust(60)
    )
    (root / "pickle").mkdir()
    (root / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    (root / "emptydir").mkdir()
    (root / "dir.safetensors").mkdir()
    (root / "new\nline.safetensors").write_bytes((root / "subset" / "model.safetensors").read_bytes())
    (root / "escape").symlink_to("/etc")
    (root / "escape.safetensors").symlink_to("/etc/hostname")
    (root / "inner.safetensors").symlink_to(root / "subset" / "model.safetensors")
    (root / "loop.safetensors").symlink_to(root / "loop.safetensors")
    os.mkfifo(root / "fifo.safetensors")
    (root / "fifodir").mkdir()
    os.mkfifo(root / "fifodir" / "model.safetensors")
    try:  # character devices inside the root (we run as root here and in CI)
        os.mknod(root / "zero.safetensors", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        os.mknod(root / "urandom.safetensors", 0o600 | stat.S_IFCHR, os.makedev(1, 9))
    except PermissionError:
        pass
    inside = sorted(str(p) for p in root.rglob("*")) + [
        str(root),
        f"{root}/",
        f"{root}/./good",
        f"{root}/../{root.name}/good",
    ]
    outside = [
        "",
        "/",
        "good",
        "./good",
        "/etc/passwd",
        "/proc/self/environ",
        "/dev/zero",
        "/nonexistent",
        f"{root}/nope",
        f"{root}/good/\x00x",
        "/" + "x" * 5000,
        f"{root}/" + "ü" * 2100,
        str(checkpoint),
        str(root.parent),
    ]
    good = [
        f"{root}/good",
        f"{root}/subset/model.safetensors",
        f"{root}/index",
        f"{root}/f16.safetensors",
        f"{root}/inner.safetensors",
    ]
    return inside + outside, good
