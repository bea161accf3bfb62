"""How the recovery soak (bench/recovery/run.py) breaks an update part way, and what it calls
the outcome. Torch-free: the soak's own process breaks disk updates and tensor streams with
it, and its trainer subprocess (bench/recovery/trainer.py) IPC updates.

- `cancel_once_written`: CancelOperation on a running update, at once or once the Operation's
  metadata says weights were written (`weights_modified`); on the tiny model a load is over in
  milliseconds, so either may come too late (the update then succeeds) or too early (nothing
  was written): every outcome is counted.
- `BrokenStream`: UpdateWeightsFromTensors built message by message (as
  tests/e2e/raw_tensor_stream.py and tests/support/fault_procs.py "stream" do): the header of
  every tensor of a checkpoint file, then the bytes of its first `count` tensors; once the
  server wrote them, the client cancels the call (cause STREAM_BROKEN) or half-closes it
  (DATA_SIZE_MISMATCH).
- `Outcome`: what a broken update ended as: PARTIAL_UPDATE (weights written: quarantined),
  refused (failed before writing: nothing changed) or completed (the break came too late).
"""

from __future__ import annotations

import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from enginectl.client import EnginectlError, Reason, TrainerClient, UpdateOperation
from enginectl.client.trainer_requests import duration
from enginectl.common import dtypes
from enginectl.common.safetensors_header import HeaderEntry, parse_header
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

POLL_S = 0.005  # WaitOperation slice while watching for the first written tensor
CHUNK_BYTES = 64 * 1024  # a broken stream's chunks: several per tensor of the tiny model


@dataclass(frozen=True)
class Outcome:
    """What a broken update ended as: "partial", "refused" or "completed"."""

    kind: str
    operation: str
    reason: str = ""  # the Operation's error reason ("" when it succeeded)
    cause: str = ""  # metadata["cause"] of a PARTIAL_UPDATE
    tensors_done: int = 0
    tensors_total: int = 0
    weights_modified: bool = False

    @classmethod
    def of(cls, op: UpdateOperation) -> Outcome:
        """The outcome of a finished Operation (RuntimeError while it still runs)."""
        if not op.done:
            raise RuntimeError(f"{op.name} still running (phase {op.progress.phase})")
        p = op.progress
        facts: dict[str, Any] = {
            "operation": op.name,
            "tensors_done": p.tensors_done,
            "tensors_total": p.tensors_total,
            "weights_modified": p.weights_modified,
        }
        if op.error is None:
            return cls("completed", **facts)
        if op.error.reason == Reason.PARTIAL_UPDATE:
            return cls("partial", reason=op.error.reason, cause=op.error.metadata.get("cause", ""), **facts)
        return cls("refused", reason=op.error.reason, **facts)


def wait_until(
    client: TrainerClient, name: str, deadline: float, written: int = 1, poll_s: float = POLL_S
) -> UpdateOperation:
    """The Operation once it wrote weights (and at least `written` tensors), ended, or
    `deadline` (monotonic) passed: WaitOperation's own timeout paces the polling."""
    while True:
        op = client.wait_operation(name, poll_s)
        p = op.progress
        if op.done or (p.weights_modified and p.tensors_done >= written) or time.monotonic() >= deadline:
            return op


def finish(client: TrainerClient, name: str, timeout: float) -> Outcome:
    """The outcome of Operation `name`, once it ended (RuntimeError if not within `timeout`)."""
    return Outcome.of(client.wait_operation(name, timeout))


def cancel_once_written(client: TrainerClient, name: str, at_once: bool, deadline: float) -> None:
    """CancelOperation on `name`: at once, or once it wrote a tensor (bounded by `deadline`).
    One that ended already ignores the cancel."""
    if not at_once:
        wait_until(client, name, deadline)
    try:
        client.cancel_operation(name, timeout=30)
    except EnginectlError:
        pass  # it ended meanwhile (the outcome says how)


# -- a tensor stream broken by its client -------------------------------------------------------
def read_checkpoint(file: Path) -> tuple[list[HeaderEntry], bytes]:
    """The tensors of a safetensors file in the order of their bytes, and those bytes."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + length :]
    return parse_header(raw[8 : 8 + length], file.name, data_size=len(data)), data


class BrokenStream:
    """An UpdateWeightsFromTensors of a checkpoint file whose client stops after its first
    `count` tensors: `start`, then (once the server wrote them) `cancel` or `half_close`."""

    def __init__(self, channel: grpc.Channel, file: Path, version: str, count: int, timeout: float) -> None:
        entries, data = read_checkpoint(file)
        self.request_id = str(uuid.uuid4())
        self.count = count
        self.header = pb2.TensorStreamHeader(
            tensors=[
                pb2.TensorSpec(name=e.name, dtype=dtypes.BY_NAME[e.dtype].proto, shape=list(e.shape)) for e in entries
            ],
            weight_version=version,
            request_id=self.request_id,
            timeout=duration(timeout),
        )
        self.tensors = len(entries)
        self.sent_bytes = entries[count - 1].end if count else 0
        self._data = data[: self.sent_bytes]
        self._stub = pb2_grpc.WeightUpdateServiceStub(channel)
        self._timeout = timeout
        self._release = threading.Event()
        self._call: Any = None

    @property
    def operation(self) -> str:
        """The Operation the stream starts (named after its request id)."""
        return f"operations/{self.request_id}"

    def _messages(self) -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
        yield pb2.UpdateWeightsFromTensorsRequest(header=self.header)
        for offset in range(0, len(self._data), CHUNK_BYTES):
            chunk = pb2.TensorStreamChunk(offset=offset, data=self._data[offset : offset + CHUNK_BYTES])
            yield pb2.UpdateWeightsFromTensorsRequest(chunk=chunk)
        # Held open here until the soak breaks the stream (bounded: the update's own timeout).
        self._release.wait(self._timeout)

    def start(self) -> None:
        self._call = self._stub.UpdateWeightsFromTensors.future(self._messages(), timeout=self._timeout + 60)

    def cancel(self) -> None:
        """The client goes away: the call is cancelled (the server's cause: STREAM_BROKEN)."""
        self._call.cancel()
        self._release.set()

    def half_close(self) -> None:
        """The client gives up cleanly: it half-closes before the last byte (DATA_SIZE_MISMATCH)."""
        self._release.set()

    def close(self) -> None:
        """End the call whatever state it is in (idempotent)."""
        self._release.set()
        if self._call is not None:
            self._call.cancel()
