"""Where a load's tensors come from: one reader per source (contract/engine.py `Source`).

Runs inside every vLLM worker process, on its RPC thread, within one LOAD worker RPC
(worker/weights/extension.py `enginectl_load`): the load opens the reader of its plan's source
(`open_reader`), hands `tensors()` to vLLM's `reload_weights` through the guarded iterator every
source shares, and closes the reader before the RPC answers. A reader only produces tensors;
vLLM's reload, on that same thread, is what writes them into the model
(worker/weights/fingerprints.py, "who may touch the weights"). A broadcast's receive thread
moves bytes into the group's receive buffers, never into the model.

- disk.py: the safetensors files, mapped copy-on-write (Source.DISK);
- stream.py: tensor-stream chunks into the reused receive buffer (Source.TENSORS);
- ipc.py: the trainer's memory, mapped (Source.IPC, worker/weights/ipc.py);
- broadcast.py: the trainer's broadcasts through an update group (Source.DISTRIBUTED,
  worker/weights/groups.py);
- staged.py: a commit, views of the staging buffer (Source.STAGED, worker/weights/staging.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from enginectl.contract.engine import Cause, LoadPlan, Source
from enginectl.worker.weights.channel import Channel
from enginectl.worker.weights.readers.broadcast import BroadcastReader
from enginectl.worker.weights.readers.disk import DiskReader
from enginectl.worker.weights.readers.ipc import IpcReader
from enginectl.worker.weights.readers.staged import StagedReader
from enginectl.worker.weights.readers.stream import StreamReader


class Reader(Protocol):
    """One load's source of tensors. Built from (the worker, the LoadPlan, the update's
    Channel): building it does what must happen before vLLM sees a tensor, and raises (Abort,
    or any error: LOAD_FAILED) with the weights untouched."""

    # What a failure of the source while it hands out tensors is reported as (an Abort
    # carries its own cause): the sender broke, or the load failed.
    broken_cause: Cause

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs to load, in order; called once."""
        ...

    def close(self) -> None:
        """Release what must not outlive the load; called once the load ended, however it
        ended (after vLLM's reload, before the RPC answers)."""
        ...


READERS: dict[Source, Callable[[Any, LoadPlan, Channel], Reader]] = {
    Source.DISK: DiskReader,
    Source.TENSORS: StreamReader,
    Source.IPC: IpcReader,
    Source.DISTRIBUTED: BroadcastReader,
    Source.STAGED: StagedReader,
}
# Every source of the contract has its reader.
_unread = [source.value for source in Source if source not in READERS]
assert not _unread, f"sources without a reader: {_unread}"


def open_reader(worker: Any, plan: LoadPlan, channel: Channel) -> Reader:
    """The reader of `plan.source` for this load on `worker` (see Reader)."""
    return READERS[plan.source](worker, plan, channel)
