"""The messages of the step before a weight update writes anything (WorkerRpc.PREPARE,
DESIGN §13 "Prepare before write"): the headers the server planned from (server/weights/
sources/disk.py), what every worker checks against them (worker/weights/prepare.py) and its
answer (server/weights/sources/prepare.py refuses on it).

Torch-free and gRPC-free, as contract/engine.py, which names the call.
"""

from __future__ import annotations

import enum

import msgspec


class PlannedTensor(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a safetensors header as the server read it: name, dtype name
    (common/dtypes.py), shape, and where its bytes lie in the data after the header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class PlannedFile(msgspec.Struct, frozen=True, array_like=True):
    """One file a disk update will read, and every tensor its header held when the server
    planned the update, in the order of their bytes."""

    path: str
    tensors: tuple[PlannedTensor, ...]


class PreparePlan(msgspec.Struct, frozen=True):
    """What every worker checks before an update writes anything (DESIGN §13, "Prepare
    before write"): each file opens here and its header is the planned one."""

    files: tuple[PlannedFile, ...]


class PrepareProblem(str, enum.Enum):
    """Why a worker can not read what an update planned (Prepared.problem; the refusal's
    `problem` metadata carries the value)."""

    MISSING = "missing"  # no such file on this worker's host
    NOT_REGULAR = "not_regular"  # a FIFO, socket, device or directory
    UNREADABLE = "unreadable"  # permissions, an I/O error
    NOT_SAFETENSORS = "not_safetensors"  # a header that is short, truncated or malformed
    HEADER_DIFFERS = "header_differs"  # another tensor, dtype, shape or offset than planned
    TRUNCATED = "truncated"  # a tensor's bytes end past the end of the file


class Prepared(msgspec.Struct, frozen=True):
    """A worker's answer to PREPARE: `problem` None when it can read every planned file,
    else the first file it can not read (`path`) and why (`message`)."""

    dp_rank: int
    worker_rank: int
    hostname: str
    seconds: float
    problem: PrepareProblem | None = None
    path: str = ""
    message: str = ""
