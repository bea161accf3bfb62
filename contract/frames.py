"""ZMQ frames of a weight update, encoded and decoded in this one place.

Per update, the server binds (server/weights/sources/channels.py) and every worker connects
(worker/weights/channel.py):
- a data channel per worker, not per DP rank (server PUSH -> worker PULL: a PUSH deals its
  messages round-robin between connected peers, so the tensor-parallel workers of one rank
  sharing one would each get part of the stream) carrying `chunk` frames (the tensor
  stream's bytes, at an offset into the concatenated tensors) and `abort` frames (stop now,
  with a cause: CancelOperation, the update's timeout, a broken client stream);
- one progress channel (workers PUSH -> server PULL) carrying (dp_rank, worker_rank, tensors,
  bytes) of what a worker has loaded (or staged) so far, and, for a stage, a `staged` frame
  from each worker when its staging ended.

Every message begins with the start's key (contract/engine_config.py `frame_key`: the
incarnation and the per-start channel secret; LoadPlan.key): a data message as its first
frame, a progress frame as its prefix. A message without it is `Unkeyed`: the reader drops and
counts it, never applies it (DESIGN §13: the channels of an engine whose ranks span hosts
listen on TCP).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

from enginectl.contract.engine import Cause

CHUNK: Final = b"chunk"
ABORT: Final = b"abort"
_OFFSET = struct.Struct("<Q")
_PROGRESS = struct.Struct("<iiIQ")
STAGED: Final = b"staged:"
_STAGED = struct.Struct("<ii")


class Unkeyed(ValueError):
    """A message that does not begin with this start's key."""


@dataclass(frozen=True)
class Chunk:
    offset: int
    data: memoryview


@dataclass(frozen=True)
class Abort:
    cause: Cause
    message: str


def chunk(offset: int, data: bytes | memoryview, key: bytes = b"") -> list[Any]:
    return [key, CHUNK, _OFFSET.pack(offset), data]


def abort(cause: Cause, message: str, key: bytes = b"") -> list[bytes]:
    return [key, ABORT, cause.value.encode(), message.encode()]


def read_data(frames: list[Any], key: bytes = b"") -> Chunk | Abort:
    """A data-channel message (frames as zmq.Frame or bytes) as a Chunk or an Abort; Unkeyed
    when it does not begin with `key`."""
    if len(frames) != 4 or _bytes(frames[0]) != key:
        raise Unkeyed("a data message without this start's key")
    kind = _bytes(frames[1])
    if kind == ABORT:
        return Abort(Cause(_bytes(frames[2]).decode()), _bytes(frames[3]).decode())
    if kind != CHUNK:
        raise ValueError(f"unknown data frame {kind[:16]!r}")
    (offset,) = _OFFSET.unpack(_bytes(frames[2]))
    data = frames[3].buffer if hasattr(frames[3], "buffer") else memoryview(frames[3])
    return Chunk(offset, data)


def progress(dp_rank: int, worker_rank: int, tensors: int, nbytes: int, key: bytes = b"") -> bytes:
    return key + _PROGRESS.pack(dp_rank, worker_rank, tensors, nbytes)


def read_progress(frame: bytes, key: bytes = b"") -> tuple[int, int, int, int]:
    """(dp_rank, worker_rank, tensors loaded, bytes loaded); Unkeyed without `key`."""
    dp_rank, worker_rank, tensors, nbytes = _PROGRESS.unpack(_unkeyed(frame, key))
    return int(dp_rank), int(worker_rank), int(tensors), int(nbytes)


def staged(dp_rank: int, worker_rank: int, key: bytes = b"") -> bytes:
    """A worker finished staging (successfully or not): read its StageResult now."""
    return key + STAGED + _STAGED.pack(dp_rank, worker_rank)


def read_report(frame: bytes, key: bytes = b"") -> tuple[int, int, int, int] | tuple[int, int]:
    """A progress-channel frame: (dp_rank, worker_rank, tensors, bytes) progress, or
    (dp_rank, worker_rank) of a `staged` report; Unkeyed without `key`."""
    frame = _unkeyed(frame, key)
    if frame.startswith(STAGED):
        dp_rank, worker_rank = _STAGED.unpack(frame[len(STAGED) :])
        return int(dp_rank), int(worker_rank)
    return read_progress(frame)


def _unkeyed(frame: bytes, key: bytes) -> bytes:
    """`frame` without its leading `key`; Unkeyed when it does not begin with it."""
    if not frame.startswith(key):
        raise Unkeyed("a progress frame without this start's key")
    return frame[len(key) :]


def _bytes(frame: Any) -> bytes:
    return bytes(frame.buffer) if hasattr(frame, "buffer") else bytes(frame)
