"""Helpers for the FPM stream, generation-state and planner tests: a real ZMQ publisher into a
server's relay, stream readers over real gRPC, and a sample's generation state by name.

The publisher is a real ZMQ PUB sending real ForwardPassMetrics frames to the relay endpoint
`enginectl serve` logs (`fpm relay listening`), exactly as each EngineCore's publisher does;
it stands in for the engine only to control the rate and the content of samples.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import grpc
import pytest
import zmq

from enginectl.contract.fpm import local_relay_key
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc
from support.serving import ServeProcess

STEP, HEARTBEAT = fpm_pb2.SAMPLE_KIND_STEP, fpm_pb2.SAMPLE_KIND_HEARTBEAT
# The state of a generating rank, as `state` names it.
RUNNING = ("RUNNING", "UNSPECIFIED")


def state(sample: fpm_pb2.ForwardPassMetrics) -> tuple[str, str]:
    """(generation state, pause reason) of a sample, by name: ("PAUSED", "CALLER")."""
    return (
        fpm_pb2.GenerationState.Name(sample.generation_state).removeprefix("GENERATION_STATE_"),
        fpm_pb2.PauseReason.Name(sample.pause_reason).removeprefix("PAUSE_REASON_"),
    )


def relay_endpoint(server: ServeProcess) -> str:
    return str(server.wait_for_event(lambda e: e.get("event") == "fpm relay listening")["endpoint"])


def frames(worker_id: str, count: int, *, ranks: int = 1, kind: int = STEP, start: int = 1) -> list[bytes]:
    """`count` samples, counter_id start.., spread round-robin over `ranks` ranks."""
    return [
        fpm_pb2.ForwardPassMetrics(
            schema_version=1,
            worker_id=worker_id,
            dp_rank=i % ranks,
            counter_id=start + i,
            incarnation="test-publisher",
            kind=kind,
            idle=kind == HEARTBEAT,
        ).SerializeToString()
        for i in range(count)
    ]


def request(
    worker_ids: Sequence[str] = (), dp_ranks: Sequence[int] = (), **fields: object
) -> svc_pb2.StreamForwardPassMetricsRequest:
    return svc_pb2.StreamForwardPassMetricsRequest(
        filter=svc_pb2.ForwardPassMetricsFilter(worker_ids=list(worker_ids), dp_ranks=list(dp_ranks)),
        **fields,  # type: ignore[arg-type]
    )


class RelayPublisher:
    """A real ZMQ PUB connected to a server's relay; `connect` waits until frames get through.
    Its frames carry the start's key, as an EngineCore's do: read where the relay keeps it for
    its host's publishers (contract/fpm.py `local_relay_key`); `send_unkeyed` sends one without."""

    def __init__(self, endpoint: str) -> None:
        self.key = local_relay_key(endpoint)
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # the test publisher never drops
        self.socket.connect(endpoint)
        self._send = self.socket.send

    def send(self, frame: bytes) -> None:
        self._send(self.key + frame)

    def send_unkeyed(self, frame: bytes) -> None:
        self._send(frame)

    async def connect(self, target: str, timeout: float = 30.0) -> None:
        """PUB drops frames until the relay's subscription reaches it: send probes until one
        comes back on a stream (a handshake, not a sleep)."""
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        async with grpc.aio.insecure_channel(target) as channel:
            call = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(request([probe]))
            await call.read()  # first progress: subscribed

            async def probes() -> None:
                while True:
                    self.send(frames(probe, 1)[0])
                    await asyncio.sleep(0.02)  # ok-sleep: pacing the probes; the stream is what we wait on

            sender = asyncio.create_task(probes())
            try:
                while True:
                    response = await asyncio.wait_for(call.read(), timeout)
                    if response.HasField("batch"):
                        break
            finally:
                sender.cancel()
                call.cancel()

    def send_all(self, data: Sequence[bytes], per_second: float | None = None) -> None:
        """Send every frame (blocking; run it in a thread), paced in 10 ms slices if asked."""
        if per_second is None:
            for f in data:
                self.send(f)
            return
        chunk = max(1, int(per_second / 100))
        t0 = time.monotonic()
        for i in range(0, len(data), chunk):
            for f in data[i : i + chunk]:
                self.send(f)
            ahead = t0 + (i + chunk) / per_second - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)  # ok-sleep: pacing the publisher's rate, not waiting for an outcome

    def close(self) -> None:
        self.socket.close(linger=1000)
        self._context.term()


async def read_until(
    call: grpc.aio.UnaryStreamCall, done: int | asyncio.Future[int], timeout: float = 60.0
) -> tuple[list[fpm_pb2.ForwardPassMetrics], int, list[svc_pb2.ForwardPassMetricsProgress]]:
    """Read batches until `done` samples were received or counted missed (or fail).

    `done` may be a future resolved later (the count is known only once a flood ends): an
    idle stream gets a progress message every second, so the count is checked again even
    when nothing more comes."""
    samples: list[fpm_pb2.ForwardPassMetrics] = []
    missed = 0
    progress: list[svc_pb2.ForwardPassMetricsProgress] = []
    deadline = time.monotonic() + timeout

    def accounted() -> bool:
        if isinstance(done, int):
            return len(samples) + missed >= done
        return done.done() and len(samples) + missed >= done.result()

    while not accounted():
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"got {len(samples)} samples + {missed} missed of {done}"
        response = await asyncio.wait_for(call.read(), remaining)
        assert response is not grpc.aio.EOF, "stream ended"
        if response.HasField("batch"):
            samples.extend(response.batch.samples)
            missed += response.batch.missed
        else:
            progress.append(response.progress)
    return samples, missed, progress


class CuttableProxy:
    """A real TCP proxy on 127.0.0.1 whose connections the test can cut: a broken network
    path between a planner and a server, caused for real."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream  # new connections go here; change it to "move" the server
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.blocked = False

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.transport.abort()
            return
        self.connections += 1
        host, port = self.upstream.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self, *, block: bool = False) -> None:
        """Drop every open connection; with `block`, refuse new ones until `blocked` is reset."""
        self.blocked = block
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


# A thread's subscriber, for tests that wait on a condition over everything streamed.
STREAM_WAIT_S = 120.0


class SampleStream:
    """A StreamForwardPassMetrics subscriber on a thread (heartbeats included), from the
    incarnation's first kept sample; `wait_for` blocks on a condition with a deadline."""

    def __init__(self, target: str) -> None:
        self.samples: list[fpm_pb2.ForwardPassMetrics] = []
        self.progress = 0
        self._cond = threading.Condition()
        self._channel = grpc.insecure_channel(target)
        request = svc_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True, resume_after_sequence=0)
        self._call = svc_grpc.ForwardPassMetricsServiceStub(self._channel).StreamForwardPassMetrics(request)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                with self._cond:
                    self.samples.extend(message.batch.samples)
                    self.progress += message.HasField("progress")
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:
            self._cond.notify_all()

    def wait_for(
        self, done: Callable[[list[fpm_pb2.ForwardPassMetrics]], bool], timeout: float = STREAM_WAIT_S
    ) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: done(self.samples) or not self._thread.is_alive(), timeout):
                pytest.fail(f"stream condition not met in {timeout}s; {len(self.samples)} samples")
            assert done(self.samples), "the stream ended"

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()
