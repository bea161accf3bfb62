"""A broadcast update in flight: `AsyncBroadcast` and its blocking view `Broadcast`.

Runs in the trainer process; made by `AsyncTrainerClient.start_broadcast` (client/trainer.py).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from enginectl.client._sync import LoopThread, blocking
from enginectl.client.trainer_requests import UpdateOptions
from enginectl.client.trainer_tensors import BroadcastGroup
from enginectl.client.trainer_types import UpdateOperation, UpdateResult
from enginectl.common.buckets import cut

if TYPE_CHECKING:
    from enginectl.client.trainer import AsyncTrainerClient


class AsyncBroadcast:
    """An UpdateWeightsFromDistributed in flight: the trainer broadcasts `tensors` in order
    through its group (`send`), then waits for the Operation (`wait`). With `bucket_bytes`
    (the request's), tensors go in buckets cut by common/buckets.py, exactly as every engine
    worker cuts them."""

    def __init__(
        self,
        client: AsyncTrainerClient,
        group: BroadcastGroup,
        operation: UpdateOperation,
        tensors: list[Any],
        options: UpdateOptions,
        progress: bool,
        bucket_bytes: int = 0,
    ) -> None:
        self.client, self.group, self.operation = client, group, operation
        self.options, self.progress = options, progress
        self._tensors = tensors
        self._buckets = cut([t.numel() * t.element_size() for t in tensors], bucket_bytes)
        self.sent = 0
        self._stop = threading.Event()

    @property
    def name(self) -> str:
        return self.operation.name

    @property
    def remaining(self) -> int:
        return len(self._tensors) - self.sent

    async def send(self, count: int | None = None) -> int:
        """Broadcast the next `count` tensors (all remaining by default), rounded up to the
        end of the bucket the last one is in; returns how many were sent. If the Operation
        ends first (cancelled, timed out), raises its error."""
        end = self.sent + (self.remaining if count is None else count)
        batch = [b for b in self._buckets if b.start >= self.sent and b.start < end]
        sending = asyncio.ensure_future(asyncio.to_thread(self.group.broadcast, self._tensors, batch, self._stop))
        ended = asyncio.ensure_future(self.client._await_done(self.name, None, None))
        try:
            await asyncio.wait({sending, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if not sending.done():
            # The server gave up on the broadcast: this group's collectives can not be trusted.
            self._stop.set()
            self.client._forget_group(self.group.name, "the update ended while broadcasting")
            sending.add_done_callback(lambda f: f.exception())
            op = ended.result()
            if op.error is not None:
                raise op.error
            raise RuntimeError(f"{self.name} ended while tensors were still being broadcast")
        try:
            self.sent += sending.result()
        except Exception:
            self.client._forget_group(self.group.name, self.group.broken)
            # The peers went away because the server ended the update (cancel, timeout, a
            # failed load): its error says why, better than gloo's "connection closed".
            op = await self.client._await_done(self.name, 30.0, None)
            if op.done and op.error is not None:
                raise op.error from None
            raise
        return sum(b.stop - b.start for b in batch)

    async def wait(self, timeout: float | None = None) -> UpdateResult:
        """Wait for the Operation; its result, or its error raised."""
        bound = timeout if timeout is not None else self.options.wait_bound()
        return (await self.client._await_operation(self.name, bound, self.progress)).result()


class Broadcast:
    """Blocking view of AsyncBroadcast (from TrainerClient.start_broadcast)."""

    def __init__(self, loop: LoopThread, inner: AsyncBroadcast) -> None:
        self._loop, self._core = loop, inner

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def operation(self) -> UpdateOperation:
        """The Operation as it was when the broadcast started."""
        return self._core.operation

    @property
    def sent(self) -> int:
        return self._core.sent

    @property
    def remaining(self) -> int:
        return self._core.remaining

    send = blocking(AsyncBroadcast.send)
    wait = blocking(AsyncBroadcast.wait)
