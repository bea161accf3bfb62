"""TensorStream: an UpdateWeightsFromTensors request stream, fed into its update's channels.

Runs in the `enginectl serve` process, on the control loop, inside the RPC's handler: the
first message is the header (`read_header`), then `feed` (the update's Feed, started by the
update, or the stage, once its workers listen) sends every chunk on to the workers and stops
the update with an abort frame on the first message out of rule (a second header, a chunk
empty or too large, out of order, past the header's size) or when the stream ends short or
breaks. `follow` keeps the call open until the stream is fed, the update ends or the server
closes, and aborts the update when the call is cancelled (the client went away).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from enginectl.contract.engine import Cause
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.limits import MAX_CHUNK_BYTES
from enginectl.server.weights.sources.channels import UpdateChannels
from enginectl.server.weights.update.operations import OperationStore, UpdateOperation
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

Messages = AsyncIterator[pb2.UpdateWeightsFromTensorsRequest]

# A broken connection ends the request stream much as a half-close does; grpc.aio tells them
# apart only by cancelling the handler, which can land just after the stream's end.
STREAM_END_GRACE_S = 0.25


async def read_header(messages: Messages) -> pb2.TensorStreamHeader:
    """The stream's first message, which must be its header (HEADER_REQUIRED otherwise)."""
    try:
        first = await messages.__anext__()
    except StopAsyncIteration:
        first = None
    if first is None or first.WhichOneof("payload") != "header":
        raise ControlPlaneError(
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.HEADER_REQUIRED,
            "the first message must be a header (tensor specs, version, options)",
        )
    return first.header


class TensorStream:
    """The chunks after the header of one call, `total` bytes in all (the header's tensors)."""

    def __init__(self, messages: Messages, total: int) -> None:
        self._messages = messages
        self._total = total
        self._fed = asyncio.Event()
        self._broken = asyncio.Event()  # the call was cancelled: the client went away
        self._channels: UpdateChannels | None = None  # the update's, once `feed` started

    async def feed(self, channels: UpdateChannels, op: UpdateOperation) -> None:
        """Send every chunk to the workers; abort the update on the first one out of rule."""
        self._channels = channels
        total = self._total
        received = 0
        try:
            async for message in self._messages:
                if channels.aborted is not None:
                    break
                if message.WhichOneof("payload") != "chunk":
                    channels.abort(Cause.HEADER_REQUIRED, "a second header: every message after the first is a chunk")
                    break
                data, offset = message.chunk.data, message.chunk.offset
                if not data or len(data) > MAX_CHUNK_BYTES:
                    channels.abort(Cause.CHUNK_TOO_LARGE, f"a chunk holds 1..{MAX_CHUNK_BYTES} bytes; got {len(data)}")
                    break
                if offset != received:
                    channels.abort(Cause.CHUNK_OUT_OF_ORDER, f"chunk offset {offset}, expected {received}")
                    break
                if received + len(data) > total:
                    channels.abort(
                        Cause.DATA_SIZE_MISMATCH,
                        f"{received + len(data)} bytes sent; the header's tensors hold {total}",
                    )
                    break
                await channels.send_chunk(offset, data)
                received += len(data)
            else:
                if received < total and not await self._broke():
                    channels.abort(
                        Cause.DATA_SIZE_MISMATCH, f"the client half-closed after {received} of {total} bytes"
                    )
                elif received < total:
                    channels.abort(Cause.STREAM_BROKEN, f"the client went away after {received} of {total} bytes")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the call broke under us
            channels.abort(Cause.STREAM_BROKEN, f"the stream broke: {type(exc).__name__}")
        finally:
            self._fed.set()

    async def follow(self, op: UpdateOperation, store: OperationStore, on_broken: Callable[[], None]) -> None:
        """Until the stream is fed, `op` ends or the store closes; while the update fails, until
        it ended (the call then ends with its error). A cancelled call (the client went away)
        calls `on_broken`, which stops the update, and cancels."""
        try:
            waiters = {
                asyncio.ensure_future(self._fed.wait()),
                asyncio.ensure_future(op.finished.wait()),
                asyncio.ensure_future(store.closing.wait()),
            }
            _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
            if not op.done and self._channels is not None and self._channels.aborted is not None:
                await store.wait(op, None)  # the update is failing: the call ends with its error
        except asyncio.CancelledError:
            self._broken.set()
            on_broken()
            raise

    async def _broke(self) -> bool:
        """After the request stream ended short: was it the connection breaking (the handler is
        cancelled within STREAM_END_GRACE_S) rather than the client half-closing?"""
        try:
            await asyncio.wait_for(self._broken.wait(), STREAM_END_GRACE_S)
        except asyncio.TimeoutError:
            return False
        return True
