"""UpdateChannels: the server's end of one update's ZMQ channels.

Runs in the `enginectl serve` process, on the control loop. A PUSH socket per worker (every
worker of every DP rank, addressed by WorkerLayout.index) carries tensor-stream chunks and
abort frames to that worker; one PULL socket receives every worker's progress. One socket per
worker, not per rank: a PUSH deals messages round-robin between its peers, so the
tensor-parallel workers of a rank sharing one would each get part of the stream, and one of
them each abort (docs/architecture.md, "Update channels"). A chunk is sent to every socket
without a copy (`copy=False`): the server holds one copy of it however many workers read it.
The frames are defined in contract/frames.py; the workers' end is worker/weights/channel.py.

When ranks run on other hosts (DESIGN §13), the sockets of their workers listen on TCP at the
head's channel address (a free port each), the progress PULL on TCP too; every message carries
the start's key and one without it is dropped and counted (`DroppedFrames`, a metric).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog
import zmq
import zmq.asyncio

from enginectl.common.host import any_port
from enginectl.contract import frames
from enginectl.contract.engine import Cause, WorkerLayout

log = structlog.get_logger("enginectl.channels")


@dataclass(frozen=True)
class ChannelSettings:
    """Where an update's channels listen and what their messages begin with, for this start."""

    key: bytes = b""  # contract/engine_config.py `frame_key`; b"": none
    # Ranks on another host than the server's (the census, server/census.py): their workers'
    # channels listen on TCP at `tcp_address` (DESIGN §13), the others' on ipc:// paths.
    remote_ranks: frozenset[int] = frozenset()
    tcp_address: str | None = None


# The settings of an engine whose ranks all run on the server's host, without a key.
ONE_HOST: Final = ChannelSettings()


class DroppedFrames:
    """Messages the server's channel ends dropped for want of this start's key (a metric)."""

    def __init__(self) -> None:
        self.unkeyed = 0


class UpdateChannels:
    """One update's ZMQ channels: a PUSH per worker (data, aborts), one PULL (progress)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        directory: Path,
        op_id: str,
        layout: WorkerLayout,
        settings: ChannelSettings = ONE_HOST,
        dropped: DroppedFrames | None = None,
    ) -> None:
        self.layout = layout
        self.key = settings.key
        self._dropped = dropped if dropped is not None else DroppedFrames()
        remote = settings.remote_ranks if settings.tcp_address is not None else frozenset()
        tcp = any_port(settings.tcp_address) if settings.tcp_address is not None else ""
        self.data: list[zmq.asyncio.Socket] = []
        endpoints = []
        for rank in layout.dp_ranks:
            for worker in range(layout.workers_per_rank):
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 16)
                endpoints.append(
                    _bind(sock, tcp if rank in remote else f"ipc://{directory}/{op_id}-data-{rank}-{worker}.sock")
                )
                self.data.append(sock)
        self.data_endpoints = tuple(endpoints)
        self.progress = ctx.socket(zmq.PULL)
        self.progress.setsockopt(zmq.LINGER, 0)
        self.progress_endpoint = _bind(self.progress, f"ipc://{directory}/{op_id}-progress.sock")
        self.progress_tcp_endpoint = _bind(self.progress, tcp) if remote else ""
        self.aborted: tuple[Cause, str] | None = None

    async def send_chunk(self, offset: int, data: bytes) -> None:
        message = frames.chunk(offset, data, self.key)
        await asyncio.gather(*(sock.send_multipart(message, copy=False) for sock in self.data))

    def abort(self, cause: Cause, message: str) -> None:
        """Tell every worker to stop; never blocks (delivery is retried in the background)."""
        if self.aborted is None:
            self.aborted = (cause, message)
        encoded = frames.abort(cause, message, self.key)
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

    async def next_report(self) -> tuple[int, int, int, int] | tuple[int, int] | None:
        """The next progress-channel frame (frames.read_report), or None for one without this
        start's key (dropped and counted)."""
        try:
            return frames.read_report(await self.progress.recv(), self.key)
        except frames.Unkeyed:
            self._dropped.unkeyed += 1
            log.warning("unkeyed progress frame dropped", dropped=self._dropped.unkeyed)
            return None

    async def next_progress(self) -> tuple[int, int, int, int]:
        """The next progress report: (dp_rank, worker_rank, tensors loaded, bytes loaded)."""
        while True:
            report = await self.next_report()
            if report is not None and len(report) == 4:
                return report

    def close(self) -> None:
        for sock in (*self.data, self.progress):
            sock.close(0)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind `sock` to `endpoint` (a TCP one on port 0: a free port) and answer where it listens."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint.startswith("tcp://") else endpoint
