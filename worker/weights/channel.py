"""The worker's end of one update's ZMQ channels (the server's end: server/weights/sources/channels.py).

Runs inside a vLLM worker, on its RPC thread (the thread that runs the LOAD worker RPC). The
frames are defined in contract/frames.py.
"""

from __future__ import annotations

import logging
import time

import zmq

from enginectl.contract import frames
from enginectl.contract.engine import Cause, LoadPlan, Source
from enginectl.worker.weights.cores import unbound
from enginectl.worker.weights.ranks import WorkerPlace

log = logging.getLogger("enginectl.worker.channel")

PROGRESS_INTERVAL_S = 0.05
POLL_MS = 20
# check() looks for an abort frame at most this often, not per tensor: polling per tensor
# adds up to a visible share of a load (bench/README.md, "Measurements behind the constants").
# An abort waits at most this long (plus the tensor being loaded) to be seen.
ABORT_POLL_S = 0.01


class Abort(Exception):
    """The update must stop, for `cause`."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Channel:
    """Data and aborts in (PULL), progress out (PUSH), and the update's deadline. The data
    channel is this worker's own (`plan.data_endpoints[place.index - plan.first_worker]`): every worker of a
    rank receives the whole stream and every abort."""

    def __init__(self, plan: LoadPlan, place: WorkerPlace) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        with unbound():  # ZMQ starts its I/O thread with the context's first socket
            self.data = self._ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.LINGER, 0)
        # This worker's place among the workers of the ranks its server manages.
        self.slot = place.index - plan.first_worker
        data_endpoint = plan.data_endpoints[self.slot]
        self.data.connect(data_endpoint)
        self.progress_socket = self._ctx.socket(zmq.PUSH)
        self.progress_socket.setsockopt(zmq.LINGER, 0)
        self.progress_socket.setsockopt(zmq.SNDHWM, 4)
        # A worker the server reaches over TCP (its rank runs on another host) reports there too.
        remote = data_endpoint.startswith("tcp://") and plan.progress_tcp_endpoint
        self.progress_socket.connect(plan.progress_tcp_endpoint if remote else plan.progress_endpoint)
        self.key = plan.key  # every message begins with it (contract/frames.py)
        self.unkeyed = 0  # data messages dropped for want of it
        # time.monotonic() based: the time left travels, not the server's clock (DESIGN §13).
        self.deadline = time.monotonic() + plan.timeout_s
        # On the tensor stream, data frames are the payload: only recv() may read them.
        self._peek_aborts = plan.source != Source.TENSORS
        self.place = place
        self._last_progress = 0.0
        self._next_abort_poll = 0.0  # time.monotonic() based
        self._latest = self._sent = (0, 0)  # (tensors, bytes) loaded; and as last reported

    def check(self) -> None:
        """Raise Abort if the server sent one (looked for at most every ABORT_POLL_S) or the
        deadline passed; never blocks."""
        if time.monotonic() > self.deadline:
            raise Abort(Cause.UPDATE_TIMEOUT, "the update's timeout elapsed")
        if not self._peek_aborts or time.monotonic() < self._next_abort_poll:
            return
        while self.data.poll(0):
            self._chunk_or_raise(self.data.recv_multipart(copy=False))
        self._next_abort_poll = time.monotonic() + ABORT_POLL_S

    def recv(self) -> frames.Chunk:
        """The next stream chunk; raises Abort on an abort frame or at the deadline."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise Abort(Cause.UPDATE_TIMEOUT, "the update's timeout elapsed while receiving")
            self.flush()
            if self.data.poll(min(POLL_MS * 10, int(remaining * 1000) + 1)):
                chunk = self._chunk_or_raise(self.data.recv_multipart(copy=False))
                if chunk is not None:
                    return chunk

    def progress(self, tensors: int, nbytes: int, *, force: bool = False) -> None:
        """Report what this worker has loaded: at most every PROGRESS_INTERVAL_S while loading;
        `flush` sends what is still unreported whenever the worker waits for data, so the
        Operation's progress never lags the weights by more than an interval and a poll."""
        self._latest = (tensors, nbytes)
        if force or time.monotonic() - self._last_progress >= PROGRESS_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self._latest == self._sent:
            return
        try:
            self.progress_socket.send(
                frames.progress(self.place.dp_rank, self.place.worker_rank, *self._latest, key=self.key), zmq.NOBLOCK
            )
        except zmq.Again:
            return  # the server is behind; the next progress or flush sends the latest
        self._sent = self._latest
        self._last_progress = time.monotonic()

    def close(self, linger_ms: int = 0) -> None:
        """Close both sockets; `linger_ms` lets progress frames still queued go out first
        (ZMQ drops them at once with 0)."""
        self.data.close(0)
        self.progress_socket.close(linger_ms)

    def _chunk_or_raise(self, message: list[zmq.Frame]) -> frames.Chunk | None:
        """A chunk, an Abort raised, or None for a message without this start's key (dropped,
        counted and logged: DESIGN §13)."""
        try:
            decoded = frames.read_data(message, self.key)
        except frames.Unkeyed:
            self.unkeyed += 1
            log.warning("enginectl: dropped %d data message(s) without this start's key", self.unkeyed)
            return None
        if isinstance(decoded, frames.Abort):
            raise Abort(decoded.cause, decoded.message)
        return decoded
