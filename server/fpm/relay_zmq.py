"""FpmRelayHost: the relay's ZMQ SUB socket, its private ipc:// endpoint (and, when the
engine's ranks span hosts, a TCP one) and its reader.

Runs in the `enginectl serve` process. It is built before the engine starts (on the main
thread, server/wiring.py): it creates a private temporary directory and binds a SUB socket
(subscribed to everything) on `ipc://<dir>/fpm.sock`; serve hands every EngineCore that `endpoint` in its
EngineConfig (contract/engine_config.py), and each rank's publisher connects to it (the frames:
contract/fpm.py). `start` runs on the control loop: it builds the FpmRelay and drains the
socket from that loop's reader callback, without a task or an await per frame.

Intake shares the control loop with every RPC, so it holds the loop for a fraction of a
millisecond at a time:
- a wakeup reads up to READ_BUDGET frames with NOBLOCK into a backlog and takes up to
  RELAY_BUDGET of them to relay (and, when behind, up to COALESCE_BUDGET older ones to
  coalesce, below);
- it parses them PREPARE_SLICE at a time, one loop turn each (`FpmRelay.prepare`), and then
  commits them (sequence, keep, fan out: `FpmRelay.commit`) in one turn per part; fan-out
  stays per wakeup's batch (relay.py), so streams write as large messages as before;
- while a prompt control call is in flight (`defer_to`: server/prompt_calls.py, counted by
  server/interceptors.py) a wakeup takes DEFERRING_* frames only.
A control call's every loop turn (gRPC's event, the call's task, the handler, the answer)
thus waits behind a slice, not a whole wakeup (bench/fpm/phase.py measures it).

A wakeup that leaves frames behind comes back after YIELD_S rather than at once: with
back-to-back wakeups the loop thread never pauses, and gRPC's own threads and the readers,
running late on shared cores, stall stream writes. When the backlog outgrows INTAKE_BACKLOG,
its oldest frames are relayed with `coalesce=True`: sequenced and kept, offered as the latest
per (worker_id, dp_rank), the rest counted in each subscriber's `missed` (relay.py): overload
is shed, never queued without bound.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import zmq

from enginectl.common.host import any_port
from enginectl.contract.fpm import SUBSCRIBE_ALL, key_file
from enginectl.server.fpm.relay import DEFAULT_QUEUE_LIMIT, DEFAULT_RING_SIZE, FpmRelay
from enginectl.server.fpm.samples import Relayed

if TYPE_CHECKING:
    from enginectl.server.weights.version.ledger import WeightVersionLedger

log = structlog.get_logger("enginectl.fpm")

# Per wakeup: frames read from the socket (a fifth of a microsecond each), relayed in full,
# and coalesced at most when behind. Once the backlog is full, a wakeup reads up to twice
# what it relays in full and coalesces the rest: under sustained overload half of what is
# read still reaches the streams in full. The YIELD_S pause costs a quarter of a microsecond
# per frame read at these sizes.
READ_BUDGET = 4096
RELAY_BUDGET = 2048
COALESCE_BUDGET = 2048
# Frames read but not relayed beyond which the oldest are coalesced at intake: four
# subscriber queues' worth (a third of a second at 50,000 samples/s), so a stall of the
# loop is caught up in full, and only sustained overload is shed.
INTAKE_BACKLOG = 4 * DEFAULT_QUEUE_LIMIT
# Pause between wakeups while behind: the loop polls (and releases the GIL) meanwhile.
YIELD_S = 0.001
# The budgets while a prompt control call runs (`defer_to`): the frames a wakeup
# leaves wait in ZMQ for a few milliseconds (RCV_HWM holds seconds of them).
DEFERRING_READ_BUDGET = 128
DEFERRING_RELAY_BUDGET = 64
# Frames parsed per loop turn (a fifth of a millisecond); a commit part (sequence, keep, fan
# out: a third of the cost per frame) takes a turn of its own.
PREPARE_SLICE = 256
# Frames ZMQ may hold for us while the loop is busy; beyond that the PUB side drops (never blocks).
RCV_HWM = 200_000
# ZMTP heartbeats on the TCP endpoint: a peer silent this long has its connection dropped.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000


@dataclass(slots=True)
class _Part:
    """Frames of one wakeup that are committed together: parsed a slice at a time into
    `prepared`, then committed (coalesced, for the backlog's stale part)."""

    frames: list[bytes]
    coalesce: bool
    prepared: list[Relayed] = field(default_factory=list)


class FpmRelayHost:
    """Owns the SUB socket and temp dir; feeds an FpmRelay from the control loop."""

    def __init__(
        self,
        *,
        ring_size: int = DEFAULT_RING_SIZE,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        require_identity: bool = False,
        intake_backlog: int = INTAKE_BACKLOG,
        defer_to: Callable[[], bool] = lambda: False,
        key: bytes = b"",
        tcp_address: str | None = None,
    ) -> None:
        if ring_size < 1 or queue_limit < 2:
            raise ValueError("--fpm-ring-size must be >= 1 and --fpm-subscriber-queue >= 2")
        # While this says so (a prompt control call is in flight), a wakeup takes small bites.
        self._defer_to = defer_to
        self._ring_size = ring_size
        self._queue_limit = queue_limit
        self._require_identity = require_identity
        self._intake_backlog = intake_backlog
        self._dir = tempfile.TemporaryDirectory(prefix="enginectl-fpm-")  # mode 0700
        self.endpoint = f"ipc://{self._dir.name}/fpm.sock"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, SUBSCRIBE_ALL)
        self._socket.setsockopt(zmq.RCVHWM, RCV_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        # Every frame begins with it (contract/engine_config.py `frame_key`); a publisher of this
        # host that is no EngineCore reads it from the private directory (contract/fpm.py).
        self._key = key
        if key:
            path = key_file(self.endpoint)
            path.touch(mode=0o600)
            path.write_bytes(key)
        # When the engine's ranks may span hosts: a TCP endpoint on `tcp_address` too, for the
        # ranks on other hosts (DESIGN §13); ZMTP heartbeats drop a peer gone silent.
        self.tcp_endpoint = ""
        if tcp_address is not None:
            self._socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            self._socket.bind(any_port(tcp_address))
            self.tcp_endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.relay: FpmRelay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._backlog: deque[bytes] = deque()  # read, not yet relayed, in arrival order
        # One wakeup's frames, oldest part first, from the read until their commit.
        self._parts: list[_Part] = []
        self._drained = True  # the last read emptied the socket
        self._resume: asyncio.Handle | None = None  # the wakeup's next step, or the next wakeup

    def start(self, ledger: WeightVersionLedger) -> FpmRelay:
        """Build the relay (incarnation and revisions from `ledger`) and start draining the
        socket; call on the loop that serves the streams. Its counters join vLLM's Prometheus
        registry where the server is wired (server/wiring.py, server/metrics.py)."""
        relay = FpmRelay(
            incarnation=ledger.incarnation,
            revision=lambda: ledger.state.revision,
            ring_size=self._ring_size,
            queue_limit=self._queue_limit,
            require_identity=self._require_identity,
            key=self._key,
        )
        self.attach(relay)
        log.info(
            "fpm relay listening",
            endpoint=self.endpoint,
            tcp_endpoint=self.tcp_endpoint or None,
            ring_size=self._ring_size,
            queue_limit=self._queue_limit,
            require_identity=self._require_identity,
        )
        return relay

    def attach(self, relay: FpmRelay) -> None:
        """Feed `relay` from the socket, on the running loop."""
        self.relay = relay
        self._loop = asyncio.get_running_loop()
        fd = self._fd = int(self._socket.getsockopt(zmq.FD))
        self._loop.add_reader(fd, self._readable)
        self._drain()  # frames already queued do not make the (edge-triggered) fd readable

    def _readable(self) -> None:
        if self._resume is None:
            self._drain()
        else:  # a wakeup is under way or scheduled: it reads next; re-arm the fd (ZMQ_EVENTS)
            self._drained = False
            self._socket.getsockopt(zmq.EVENTS)

    def _drain(self) -> None:
        """One wakeup: read what the socket holds (up to READ_BUDGET frames), take the
        backlog beyond `intake_backlog` to coalesce and up to RELAY_BUDGET frames to relay,
        and start preparing them (`_prepare`); smaller bites while the relay defers to a
        control call. ZMQ's fd is edge-triggered: a wakeup that leaves frames behind
        schedules the next one itself (`_commit`)."""
        relay, backlog = self.relay, self._backlog
        assert relay is not None
        self._resume = None
        if self._defer_to():
            read, relayed, coalesced = DEFERRING_READ_BUDGET, DEFERRING_RELAY_BUDGET, DEFERRING_RELAY_BUDGET
        else:
            read, relayed, coalesced = READ_BUDGET, RELAY_BUDGET, COALESCE_BUDGET
        recv, noblock = self._socket.recv, zmq.NOBLOCK
        self._drained = False
        try:
            for _ in range(read):
                backlog.append(recv(noblock))
        except zmq.Again:
            self._drained = True
        except zmq.ZMQError:  # socket closed under us during shutdown
            return
        stale = max(0, min(len(backlog) - self._intake_backlog, coalesced))
        self._parts = [
            _Part([backlog.popleft() for _ in range(stale)], coalesce=True),
            _Part([backlog.popleft() for _ in range(min(relayed, len(backlog)))], coalesce=False),
        ]
        self._prepare()

    def _prepare(self) -> None:
        """Parse PREPARE_SLICE of this wakeup's frames, oldest first; come back in the next
        loop turn for the rest, so whatever else is ready (a control call's next step) runs
        in between; then commit."""
        relay, loop = self.relay, self._loop
        assert relay is not None and loop is not None
        budget = PREPARE_SLICE
        for part in self._parts:
            if part.frames and budget:
                frames, part.frames = part.frames[:budget], part.frames[budget:]
                relay.prepare(frames, part.prepared)
                budget -= len(frames)
        more = any(part.frames for part in self._parts)
        self._resume = loop.call_soon(self._prepare if more else self._commit)

    def _commit(self) -> None:
        """Sequence, keep and offer the oldest part this wakeup prepared (coalesced if it is
        the backlog's stale part); the next part in the next turn (nothing else sequences in
        between: the order holds); after the last, schedule the next wakeup if frames are
        left."""
        relay, loop = self.relay, self._loop
        assert relay is not None and loop is not None
        part = self._parts.pop(0)
        relay.commit(part.prepared, coalesce=part.coalesce)
        if self._parts:
            self._resume = loop.call_soon(self._commit)
        elif self._backlog or not self._drained:
            self._resume = loop.call_later(YIELD_S, self._drain)
        else:
            self._resume = None

    async def stop(self) -> None:
        """Stop reading, close the socket and remove the temp dir; call on the relay's loop."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        self._socket.close(linger=0)
        self._context.term()
        self._dir.cleanup()
