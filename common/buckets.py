"""How a bucketed broadcast cuts its tensors into buckets: one rule for both ends.

Pure Python (no torch): the trainer client (client/trainer_tensors.py) packs and sends, every
engine worker (worker/weights/groups.py) receives and unpacks, and both must cut the same
list of tensors the same way (UpdateWeightsFromDistributedRequest.bucket_bytes, docs/weights.md
"Bucketed broadcasts"):

- walking the tensors in order, a tensor joins the open bucket if the bucket's bytes plus its
  own stay within `bucket_bytes`, else it starts the next bucket;
- a bucket of one tensor (every tensor larger than `bucket_bytes` is one) is broadcast as that
  tensor, in its own dtype and shape: nothing to pack;
- a bucket of several is one contiguous uint8 tensor holding their raw bytes back to back
  (C-contiguous, no padding), one collective for all of them.

`bucket_bytes` 0 means no buckets: one broadcast per tensor, as before buckets existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_BUCKET_BYTES = 4 << 30  # the proto's bound (BUCKET_BYTES_INVALID above it)


@dataclass(frozen=True)
class Bucket:
    """Tensors `start` .. `stop - 1` of an update, `nbytes` in all; `offsets[i]` is where
    tensor `start + i` begins in the packed buffer."""

    start: int
    stop: int
    nbytes: int
    offsets: tuple[int, ...]

    @property
    def packed(self) -> bool:
        """Broadcast as one flat uint8 buffer (more than one tensor), not as the tensor itself."""
        return self.stop - self.start > 1


def cut(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """The buckets of tensors of `sizes` bytes, in order (see the module docstring)."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, not {bucket_bytes}")
    buckets: list[Bucket] = []
    start, total = 0, 0
    offsets: list[int] = []
    for index, size in enumerate(sizes):
        if index > start and (bucket_bytes == 0 or total + size > bucket_bytes):
            buckets.append(Bucket(start, index, total, tuple(offsets)))
            start, total, offsets = index, 0, []
        offsets.append(total)
        total += size
    if start < len(sizes):
        buckets.append(Bucket(start, len(sizes), total, tuple(offsets)))
    return buckets
