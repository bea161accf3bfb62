"""The relay's records of samples: a relayed sample and its wire form (`Relayed`), the ring
that keeps the newest ones (`SampleRing`) and what a subscription selects (`SampleFilter`).

Runs in the `enginectl serve` process, on the control loop, except where a method says it is
safe from another thread (a metrics scrape). Pure Python: no ZMQ, no gRPC, no vLLM. The
relay that numbers, keeps and fans them out is relay.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1.forward_pass_metrics_pb2 import ForwardPassMetrics as Sample

HEARTBEAT = fpm_pb2.SAMPLE_KIND_HEARTBEAT
# Tags of ForwardPassMetrics.sequence (17) and .weight_revision (18), and of
# ForwardPassMetricsBatch.samples (1), as varint-typed and length-delimited fields.
_SEQUENCE_TAG, _REVISION_TAG, _SAMPLES_TAG = b"\x88\x01", b"\x90\x01", b"\x0a"


def varint(value: int) -> bytes:
    """Protobuf base-128 varint encoding of a non-negative integer."""
    if value < 0x80:  # the common sizes without a loop: lengths, and sequences below 2**28
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    if value < 0x10000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80, value >> 21))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Relayed:
    """A relayed sample: what filters and coalescing read from it (its (worker_id, dp_rank)
    `key`, whether it is a heartbeat, its `sequence`), the `revision` it was stamped with, the
    publisher's `frame`, and its wire form as one `samples` entry of a ForwardPassMetricsBatch,
    shared by every stream.

    The parsed message is not kept: intake reads the three fields it needs and lets it go while
    it is still in the cache. Freeing ten thousand parsed messages later, as the ring evicted
    them, cost the intake as much as parsing them (profiled under overload, bench/fpm/phase.py).
    `sample` parses the frame again for the few readers that want the message.

    Protobuf lets a serialized message be extended by appending fields, so stamping the
    publisher's frame costs a few bytes, not a re-serialization; the publisher leaves
    `sequence` and `weight_revision` unset (and were they set, the appended values win).
    The wire form is built by the first stream that sends the sample (`wire or stamp()`): a
    sample that every queue coalesced away under overload never costs one."""

    __slots__ = ("key", "heartbeat", "sequence", "revision", "frame", "wire")

    def __init__(self, key: tuple[str, int], heartbeat: bool, frame: bytes) -> None:
        self.key = key
        self.heartbeat = heartbeat
        self.sequence = self.revision = 0  # until FpmRelay.commit
        self.frame = frame
        self.wire = b""  # until `stamp`

    @property
    def sample(self) -> Sample:
        """The sample as streams send it (parsed again from the frame, stamped)."""
        sample = Sample.FromString(self.frame)
        sample.sequence = self.sequence
        sample.weight_revision = self.revision
        return sample

    def stamp(self) -> bytes:
        """The wire form (built once)."""
        if not self.wire:
            frame, stamp = self.frame, _SEQUENCE_TAG + varint(self.sequence)
            if self.revision:
                stamp += _REVISION_TAG + varint(self.revision)
            self.wire = b"".join((_SAMPLES_TAG, varint(len(frame) + len(stamp)), frame, stamp))
        return self.wire


@dataclass(frozen=True)
class SampleFilter:
    """Which samples a subscription wants. None: no restriction on that field."""

    worker_ids: frozenset[str] | None = None
    dp_ranks: frozenset[int] | None = None
    include_heartbeats: bool = False

    def wants(self, key: tuple[str, int], heartbeat: bool) -> bool:
        """Whether a sample of `key` (worker_id, dp_rank), heartbeat or step, passes."""
        if heartbeat and not self.include_heartbeats:
            return False
        if self.worker_ids is not None and key[0] not in self.worker_ids:
            return False
        return self.dp_ranks is None or key[1] in self.dp_ranks

    def select(self, batch: list[Relayed]) -> list[Relayed]:
        """The samples of `batch` this filter wants, in order (one pass, no call per sample)."""
        workers, ranks, heartbeats = self.worker_ids, self.dp_ranks, self.include_heartbeats
        if workers is None and ranks is None:
            return batch if heartbeats else [r for r in batch if not r.heartbeat]
        return [
            r
            for r in batch
            if (heartbeats or not r.heartbeat)
            and (workers is None or r.key[0] in workers)
            and (ranks is None or r.key[1] in ranks)
        ]


class SampleRing:
    """The newest `size` samples, addressed by sequence (contiguous from `oldest` to `head`).
    FpmRelay.commit fills `slots` and advances `head`, a batch at a time."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("ring size must be at least 1")
        self.size = size
        self.slots: list[Relayed | None] = [None] * size
        self.head = 0  # newest sequence assigned; 0 before the first

    @property
    def oldest(self) -> int:
        """The oldest sequence kept; 0 while empty."""
        if self.head == 0:
            return 0
        return max(1, self.head - self.size + 1)

    def newest(self) -> Relayed | None:
        """The newest sample kept, None while empty. Safe from another thread (a metrics
        scrape): it may miss a sample appended meanwhile, never return an older one."""
        return self.slots[self.head % self.size] if self.head else None

    def get(self, sequence: int) -> Relayed:
        """The sample with `sequence` (caller checks oldest <= sequence <= head)."""
        relayed = self.slots[sequence % self.size]
        assert relayed is not None
        return relayed
