"""FpmRelayHost: the relay's ZMQ SUB socket, its private ipc:// endpoint and its reader.

Runs in the `enginectl serve` process. `bind` runs before the engine starts (on the main
thread): it creates a private temporary directory and binds a SUB socket (subscribed to
everything) on `ipc://<dir>/fpm.sock`; serve hands every EngineCore that `endpoint` in its
EngineConfig (contract/engine.py), and each rank's publisher connects to it (the frames:
contract/fpm.py). `start` runs on the control loop: it builds the FpmRelay and drains the
socket from that loop's reader callback, without a task or an await per frame (a frame
costs a parse and a few appends: at 50,000 samples/s that is what keeps it cheap).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import zmq

from enginectl.contract.fpm import SUBSCRIBE_ALL
from enginectl.server.fpm.relay import DEFAULT_QUEUE_LIMIT, DEFAULT_RING_SIZE, FpmRelay

if TYPE_CHECKING:
    from enginectl.server.weights.ledger import WeightVersionLedger

log = structlog.get_logger("enginectl.fpm")

# Frames read per reader callback before yielding to the loop (gRPC writes interleave).
DRAIN_BUDGET = 512
# Frames ZMQ may hold for us while the loop is busy; beyond that the PUB side drops (never blocks).
RCV_HWM = 200_000


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its error message
    return parse


def add_fpm_relay_args(group: argparse._ArgumentGroup) -> None:
    """The relay's `enginectl serve` flags."""
    group.add_argument(
        "--fpm-ring-size",
        type=_at_least(1),
        default=DEFAULT_RING_SIZE,
        help=f"Forward-pass metrics samples kept for resuming streams (default {DEFAULT_RING_SIZE}).",
    )
    group.add_argument(
        "--fpm-subscriber-queue",
        type=_at_least(2),
        default=DEFAULT_QUEUE_LIMIT,
        help="Samples queued per stream before it coalesces to the latest per "
        f"(worker_id, dp_rank) and counts the rest as missed (default {DEFAULT_QUEUE_LIMIT}).",
    )


class FpmRelayHost:
    """Owns the SUB socket and temp dir; feeds an FpmRelay from the control loop."""

    def __init__(
        self,
        *,
        ring_size: int = DEFAULT_RING_SIZE,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        require_identity: bool = False,
    ) -> None:
        if ring_size < 1 or queue_limit < 2:
            raise ValueError("--fpm-ring-size must be >= 1 and --fpm-subscriber-queue >= 2")
        self._ring_size = ring_size
        self._queue_limit = queue_limit
        self._require_identity = require_identity
        self._dir = tempfile.TemporaryDirectory(prefix="enginectl-fpm-")  # mode 0700
        self.endpoint = f"ipc://{self._dir.name}/fpm.sock"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, SUBSCRIBE_ALL)
        self._socket.setsockopt(zmq.RCVHWM, RCV_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self.relay: FpmRelay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    @classmethod
    def bind(cls, args: argparse.Namespace) -> FpmRelayHost:
        """Bind before the engine starts, so `endpoint` can go into every EngineCore's config."""
        return cls(
            ring_size=args.fpm_ring_size,
            queue_limit=args.fpm_subscriber_queue,
            require_identity=bool(getattr(args, "await_worker_id", False)),
        )

    def start(self, ledger: WeightVersionLedger, *, export_metrics: bool = True) -> FpmRelay:
        """Build the relay (incarnation and revisions from `ledger`) and start draining the
        socket; call on the loop that serves the streams. With `export_metrics`, the relay's
        counters join vLLM's Prometheus registry (once per process)."""
        relay = FpmRelay(
            incarnation=ledger.incarnation,
            revision=lambda: ledger.state.revision,
            ring_size=self._ring_size,
            queue_limit=self._queue_limit,
            require_identity=self._require_identity,
        )
        if export_metrics:
            from enginectl.server.metrics import register_fpm_metrics

            register_fpm_metrics(relay)
        self.attach(relay)
        log.info(
            "fpm relay listening",
            endpoint=self.endpoint,
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
        self._loop.add_reader(fd, self._drain)
        self._drain()  # frames already queued do not make the (edge-triggered) fd readable

    def _drain(self) -> None:
        relay, sock = self.relay, self._socket
        assert relay is not None and self._loop is not None
        accept, recv, noblock = relay.accept, sock.recv, zmq.NOBLOCK
        for _ in range(DRAIN_BUDGET):
            try:
                frame = recv(noblock)
            except zmq.Again:
                return
            except zmq.ZMQError:  # socket closed under us during shutdown
                return
            accept(frame)
        # Budget spent with frames left: the fd will not fire again for them; come back.
        self._loop.call_soon(self._drain)

    async def stop(self) -> None:
        """Stop reading, close the socket and remove the temp dir; call on the relay's loop."""
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        self._socket.close(linger=0)
        self._context.term()
        self._dir.cleanup()
