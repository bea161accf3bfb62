"""The JSON header of a safetensors file (after its 8-byte length), parsed and checked.

Torch-free, shared by both ends of a disk update: the `enginectl serve` process checks
every file's header before planning the update (server/weights/sources/disk.py `read_header`); each
worker maps the file and views every tensor where the header says its bytes lie
(worker/weights/readers/disk.py `mapped_safetensors`), or, staging, reads those bytes into its
staging buffer (worker/weights/staging.py `_read_files`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from enginectl.common import dtypes


class HeaderError(ValueError):
    """The header is not that of a safetensors file enginectl can load (the message says why,
    starting with the file's name)."""


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # a name of common/dtypes.py
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data that follows the header
    end: int


def parse_header(
    raw: bytes, file: str, *, data_size: int | None = None, max_rank: int | None = None
) -> list[HeaderEntry]:
    """The tensors `raw` describes, in the order of their bytes. HeaderError if it is not a
    JSON object of well-formed entries whose offsets match their dtype and shape, names no
    tensor, or (given `data_size`, the bytes after the header) a tensor ends past the file's
    end; given `max_rank`, a shape of more dimensions is refused too."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HeaderError(f"{file}: malformed safetensors header") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{file}: malformed safetensors header")
    entries: list[HeaderEntry] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtypes.BY_SAFETENSORS[entry["dtype"]].name
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{file}: malformed entry for tensor {name!r}") from None
        if (max_rank is not None and len(shape) > max_rank) or any(d < 0 for d in shape):
            raise HeaderError(f"{file}: tensor {name!r} has a malformed shape {list(shape)}")
        if end - begin != dtypes.nbytes(dtype, shape) or begin < 0:
            raise HeaderError(f"{file}: tensor {name!r} has inconsistent offsets")
        if data_size is not None and end > data_size:
            raise HeaderError(f"{file}: truncated (tensor {name!r} ends past the end of the file)")
        entries.append(HeaderEntry(name, dtype, shape, begin, end))
    if not entries:
        raise HeaderError(f"{file}: holds no tensor")
    return sorted(entries, key=lambda e: e.begin)
