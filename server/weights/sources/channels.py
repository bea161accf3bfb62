"""UpdateChannels: the server's end of one update's ZMQ channels.

Runs in the `enginectl serve` process, on the control loop. A PUSH socket per worker (every
worker of every DP rank, addressed by WorkerLayout.index) carries tensor-stream chunks and
abort frames to that worker; one PULL socket receives every worker's progress. One socket per
worker, not per rank: a PUSH deals messages round-robin between its peers, so the
tensor-parallel workers of a rank sharing one would each get part of the stream, and one of
them each abort (docs/architecture.md, "Update channels"). A chunk is sent to every socket
without a copy (`copy=False`): the server holds one copy of it however many workers read it.
The frames are defined in contract/frames.py; the workers' end is worker/weights/channel.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from enginectl.contract import frames
from enginectl.contract.engine import Cause, WorkerLayout


class UpdateChannels:
    """One update's ZMQ channels: a PUSH per worker (data, aborts), one PULL (progress)."""

    def __init__(self, ctx: zmq.asyncio.Context, directory: Path, op_id: str, layout: WorkerLayout) -> None:
        self.layout = layout
        self.data_endpoints = tuple(
            f"ipc://{directory}/{op_id}-data-{rank}-{worker}.sock"
            for rank in range(layout.ranks)
            for worker in range(layout.workers_per_rank)
        )
        self.progress_endpoint = f"ipc://{directory}/{op_id}-progress.sock"
        self.data: list[zmq.asyncio.Socket] = []
        for endpoint in self.data_endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.bind(endpoint)
            self.data.append(sock)
        self.progress = ctx.socket(zmq.PULL)
        self.progress.setsockopt(zmq.LINGER, 0)
        self.progress.bind(self.progress_endpoint)
        self.aborted: tuple[Cause, str] | None = None

    async def send_chunk(self, offset: int, data: bytes) -> None:
        message = frames.chunk(offset, data)
        await asyncio.gather(*(sock.send_multipart(message, copy=False) for sock in self.data))

    def abort(self, cause: Cause, message: str) -> None:
        """Tell every worker to stop; never blocks (delivery is retried in the background)."""
        if self.aborted is None:
            self.aborted = (cause, message)
        encoded = frames.abort(cause, message)
        for sock in self.data:
            asyncio.ensure_future(self._send_abort(sock, encoded))

    @staticmethod
    async def _send_abort(sock: zmq.asyncio.Socket, encoded: list[bytes]) -> None:
        """Deliver an abort frame, retrying while the worker has not connected yet (a PUSH with
        no peer refuses at once) or its queue is full; ends when the channel closes."""
        while not sock.closed:
            try:
                await sock.send_multipart(encoded, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await asyncio.sleep(0.01)
            except zmq.ZMQError:
                return

    async def next_progress(self) -> tuple[int, int, int, int]:
        """The next progress report: (dp_rank, worker_rank, tensors loaded, bytes loaded)."""
        return frames.read_progress(await self.progress.recv())

    def close(self) -> None:
        for sock in (*self.data, self.progress):
            sock.close(0)
