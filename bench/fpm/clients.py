"""FPM load processes of the benchmark: `python -m bench.fpm.clients subscribe|publish`.

Each runs in its own subprocess, started by `python -m bench` (bench/fpm/phase.py), and reports
JSON lines on stdout (`ready`, `probe_seen`, `result`, `error`). Every loop is bounded in
count and time.

- subscribe: K StreamForwardPassMetrics subscribers (grpc.aio, one channel each) on one
  server. Each counts the samples it receives and the ones it is told it `missed`, checks
  that sequences increase from batch to batch, and (with --latency) records receive time
  minus each sample's `emit_time` (same host clock: the publisher's or the EngineCore's).
  With --probe, one more stream watches for the publishers' probe samples and reports each
  the first time it arrives. Ends when every subscriber accounted for --expect samples, on
  `stop` from the parent, or at the time bound.
- publish: a real ZMQ PUB connected to the server's relay endpoint, as an EngineCore's
  publisher is. Sends probe samples until the parent writes `go` (the parent waits for a
  subscriber to see one: PUB drops frames until the relay's subscription has reached it),
  then --count samples at --rate in 1 ms slices, each stamped with its slice's emit_time.
- rpc-probe: GetWeightVersion on the same server, one call every --interval-ms on one
  blocking channel, over windows the parent opens with `start` and closes with `stop`
  (each `stop` reports that window's latencies): the control RPCs the relay's loop must
  keep serving while it is flooded.
"""

from __future__ import annotations

import argparse
import asyncio
import select
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
import zmq

from bench.lib.lines import emit, report_errors
from bench.lib.stats import summarize_ms
from enginectl.contract.fpm import local_relay_key
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc


# -- subscribe -------------------------------------------------------------------------------
@dataclass
class _Subscriber:
    received: int = 0
    missed: int = 0
    out_of_order: int = 0
    last_sequence: int = 0
    first_at: float | None = None
    last_at: float | None = None
    latencies: list[float] = field(default_factory=list)

    def accounted(self) -> int:
        return self.received + self.missed


async def _subscribe(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    probes_seen: set[str] = set()
    probes = set(args.probe)
    subs = [_Subscriber() for _ in range(args.subscribers)]
    ready = 0
    all_ready = asyncio.Event()
    request = svc_pb2.StreamForwardPassMetricsRequest(
        filter=svc_pb2.ForwardPassMetricsFilter(worker_ids=args.worker),
        include_heartbeats=args.heartbeats,
    )

    async def watch_probes() -> None:
        async with grpc.aio.insecure_channel(args.target) as channel:
            call = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(
                svc_pb2.StreamForwardPassMetricsRequest(filter=svc_pb2.ForwardPassMetricsFilter(worker_ids=args.probe))
            )
            try:
                async for response in call:
                    for sample in response.batch.samples:
                        if sample.worker_id not in probes_seen:
                            probes_seen.add(sample.worker_id)
                            emit("probe_seen", probe=sample.worker_id)
                    if probes_seen == probes:
                        return
            finally:
                call.cancel()

    async def follow(sub: _Subscriber) -> None:
        nonlocal ready
        async with grpc.aio.insecure_channel(args.target) as channel:
            call = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(request)
            await call.read()  # progress: subscribed
            ready += 1
            if ready == len(subs):
                all_ready.set()
            reader = asyncio.ensure_future(call.read())
            stopping = asyncio.ensure_future(stop.wait())
            try:
                while True:
                    done, _ = await asyncio.wait({reader, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    if stopping in done:
                        return
                    response = reader.result()
                    if response is grpc.aio.EOF:
                        return
                    reader = asyncio.ensure_future(call.read())
                    if not response.HasField("batch"):
                        continue
                    now = time.time()
                    batch = response.batch
                    samples = batch.samples
                    sub.missed += batch.missed
                    # Per batch, not per sample: at 8 x 50,000 samples/s this process must
                    # not be the bottleneck it measures (the server orders within a batch).
                    if samples[0].sequence <= sub.last_sequence:
                        sub.out_of_order += 1
                    sub.last_sequence = samples[-1].sequence
                    sub.received += len(samples)
                    if args.latency:
                        for sample in samples:
                            emitted = sample.emit_time.seconds + sample.emit_time.nanos * 1e-9
                            sub.latencies.append(now - emitted)
                    if sub.received:
                        sub.first_at = sub.first_at or now
                        sub.last_at = now
                    if args.expect and all(s.accounted() >= args.expect for s in subs):
                        stop.set()
            finally:
                reader.cancel()
                stopping.cancel()
                call.cancel()

    def stdin_reader(loop: asyncio.AbstractEventLoop) -> None:
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline and not stop.is_set():
            r, _, _ = select.select([sys.stdin], [], [], 0.2)
            if r:
                line = sys.stdin.readline()
                if not line or line.strip() == "stop":
                    break
        loop.call_soon_threadsafe(stop.set)

    loop = asyncio.get_running_loop()
    threading.Thread(target=stdin_reader, args=(loop,), daemon=True).start()
    tasks = [asyncio.create_task(follow(s)) for s in subs]
    await asyncio.wait_for(all_ready.wait(), 60)
    emit("ready", subscribers=len(subs))
    if probes:  # after `ready`: the parent reads `probe_seen` lines only after that one
        tasks.append(asyncio.create_task(watch_probes()))
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies = [x for s in subs for x in s.latencies]
    emit(
        "result",
        subscribers=[
            {
                "received": s.received,
                "missed": s.missed,
                "out_of_order": s.out_of_order,
                "first_at": s.first_at,
                "last_at": s.last_at,
            }
            for s in subs
        ],
        latency=summarize_ms(latencies) if args.latency else None,
    )


def cmd_subscribe(args: argparse.Namespace) -> None:
    asyncio.run(_subscribe(args))


# -- publish ---------------------------------------------------------------------------------
def _message(worker: str, rank: int, counter: int = 1) -> fpm_pb2.ForwardPassMetrics:
    msg = fpm_pb2.ForwardPassMetrics(
        schema_version=1,
        worker_id=worker,
        dp_rank=rank,
        counter_id=counter,
        identity_generation=1,
        incarnation="bench-publisher",
        kind=fpm_pb2.SAMPLE_KIND_STEP,
        wall_time=0.01,
        kv_cache_usage=0.25,
        num_running=4,
        num_waiting=1,
    )
    msg.scheduled.num_decode_requests = 4
    msg.scheduled.sum_decode_kv_tokens = 512
    msg.emit_time.GetCurrentTime()
    return msg


def _sample(worker: str, rank: int, counter: int) -> bytes:
    return _message(worker, rank, counter).SerializeToString()


def cmd_publish(args: argparse.Namespace) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)  # the bench publisher never drops: loss is the relay's
    sock.connect(args.endpoint)
    key = local_relay_key(args.endpoint)  # every frame carries the start's key, as an EngineCore's
    emit("ready")
    go = threading.Event()

    def wait_go() -> None:
        sys.stdin.readline()
        go.set()

    threading.Thread(target=wait_go, daemon=True).start()
    deadline = time.monotonic() + 60
    while not go.wait(0.01):  # probes until the parent has seen one come through
        if time.monotonic() > deadline:
            emit("error", message="no go from the parent")
            return
        sock.send(key + _sample(args.probe, 0, 1))
    # Send in 1 ms slices at the requested rate. One message per rank, reused: a sample costs
    # its counter and a serialization (well under a microsecond), so that at 150,000 samples/s
    # the publishers do not take the CPU the relay is measured on; emit_time is per slice.
    messages = [_message(args.worker, rank) for rank in range(args.ranks)]
    per_slice = max(1, int(args.rate / 1000))
    t0 = time.monotonic()
    sent = 0
    while sent < args.count:
        n = min(per_slice, args.count - sent)
        now_ns = time.time_ns()
        for msg in messages:
            msg.emit_time.FromNanoseconds(now_ns)
        for i in range(sent, sent + n):
            msg = messages[i % args.ranks]
            msg.counter_id = i + 1
            sock.send(key + msg.SerializeToString())
        sent += n
        ahead = t0 + sent / args.rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # pacing the offered rate
    elapsed = time.monotonic() - t0
    emit("result", sent=sent, elapsed_s=round(elapsed, 3), rate=round(sent / elapsed, 1), t0_wall=time.time() - elapsed)
    sock.close(linger=5000)
    context.term()


# -- rpc-probe -------------------------------------------------------------------------------
def cmd_rpc_probe(args: argparse.Namespace) -> None:
    from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
    from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

    channel = grpc.insecure_channel(args.target)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = wv_grpc.WeightVersionServiceStub(channel).GetWeightVersion
    request = wv_pb2.GetWeightVersionRequest()
    for _ in range(20):  # warm the channel and the server's handler path
        call(request, timeout=30)
    emit("ready")
    interval = args.interval_ms / 1e3
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        line = sys.stdin.readline().strip()
        if line != "start":
            break
        stop = threading.Event()

        def wait_stop(stop: threading.Event = stop) -> None:
            sys.stdin.readline()
            stop.set()

        threading.Thread(target=wait_stop, daemon=True).start()
        latencies: list[float] = []
        errors = 0
        while not stop.is_set() and time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                call(request, timeout=30)
                latencies.append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors += 1
            stop.wait(max(0.0, interval - (time.perf_counter() - t0)))  # pacing the calls
        emit("result", latency=summarize_ms(latencies), errors=errors)
    channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fpm.clients")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("subscribe")
    p.add_argument("--target", required=True)
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--worker", action="append", default=[], help="only samples of these worker ids")
    p.add_argument("--probe", action="append", default=[], help="probe worker ids: report when first seen")
    p.add_argument("--heartbeats", action="store_true")
    p.add_argument("--latency", action="store_true")
    p.add_argument("--expect", type=int, default=0, help="end once every subscriber accounted for this many")
    p.add_argument("--max-seconds", type=float, default=120.0)
    p = sub.add_parser("publish")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--probe", required=True, help="worker id of the probe samples sent before `go`")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--count", type=int, required=True)
    p = sub.add_parser("rpc-probe")
    p.add_argument("--target", required=True)
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    command = {"subscribe": cmd_subscribe, "publish": cmd_publish, "rpc-probe": cmd_rpc_probe}[args.cmd]
    return report_errors(lambda: command(args))


if __name__ == "__main__":
    sys.exit(main())
