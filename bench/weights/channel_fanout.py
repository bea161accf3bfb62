"""The tensor stream's fan-out to the workers of a rank, measured (bench/README.md, "Update
channels"; docs/architecture.md): no vLLM, no torch.

With tensor parallelism every worker of a DP rank loads every tensor, so every worker must get
the whole stream. Two ways to give it to them, both measured here on the same bytes, rep by
rep and interleaved:

- **per_worker** (what enginectl does): the server's end, a real `UpdateChannels`
  (server/weights/sources/channels.py) for `WorkerLayout(1, W)`, binds a PUSH per worker and sends
  every chunk to each of them without a copy (`copy=False`);
- **relay**: the same `UpdateChannels` for `WorkerLayout(1, 1)`, one PUSH per rank, read by
  worker 0 alone, which passes every chunk on to the W-1 others (a PUSH of its own per peer,
  also without a copy).

Each worker is a process of its own running the workers' real end, a `Channel`
(worker/weights/channel.py) built from a `LoadPlan` and a `WorkerPlace`, as vLLM's workers
do; it copies every chunk into a buffer allocated (and faulted in) once, at its offset, as a
load copies it into the parameters, and reports progress as a worker does (not read here: a
progress frame may be dropped when its queue is full, which a worker's RPC answer makes up for).

Measured per way and W: wall time from the first chunk sent to the last worker's copy of its
last chunk (each side reads the host's clock, `time.time()`), and the GB/s each worker got; the bytes each worker received (each must get the whole
payload) and passed on; CPU seconds of this process (the server's end) and of each worker
(all threads: ZMQ's I/O threads too); the peak RSS growth during the send of this process and of
each worker: the chunks held in queues (a chunk sent to W sockets without a copy is held once;
a worker's PULL queues up to ZMQ's default receive high-water mark of 1000 messages when it
copies more slowly than its socket reads).

Runs in two kinds of process: `python -m bench.weights.channel_fanout [--quick]` is the
server's end (this process; from the tensor_parallel phase, bench/weights/tensor_parallel.py,
or alone); it prints the table on stderr and a `result` JSON line on stdout, and starts
`python -m bench.weights.channel_fanout recv --index I --payload N` for each worker, which
speak JSON lines (bench/lib/lines.py) on stdin and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import zmq
import zmq.asyncio

from bench.lib.lines import emit, report_errors
from enginectl.contract import frames
from enginectl.contract.engine import LoadPlan, Source, WorkerLayout

CHUNK_BYTES = 1 << 20  # the tensor stream's chunk here (the trainer client's is its own choice)
WORKERS = (1, 2, 4)
WAYS = ("per_worker", "relay")
REP_TIMEOUT_S = 60.0
RSS_SAMPLE_S = 0.005


class RssPeak:
    """The peak growth of this process's RSS while it runs, sampled on a thread."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        """Bytes the RSS grew by at its peak."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak - self.base


# -- a worker's end ------------------------------------------------------------------------
def recv(index: int, payload: int) -> None:
    """One worker: per rep (a JSON line on stdin naming its channel), receive the whole payload
    through a Channel into a buffer allocated once; with `relay_to`, pass each chunk on too."""
    from enginectl.worker.weights.channel import Channel
    from enginectl.worker.weights.ranks import WorkerPlace

    buffer = bytearray(b"\x01") * payload  # faulted in now, reused by every rep (as parameters are)
    view = memoryview(buffer)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    emit("ready", index=index)
    for line in sys.stdin:
        rep = json.loads(line)
        plan = LoadPlan(
            source=Source.TENSORS,
            files=(),
            tensors=(),
            group="",
            data_endpoints=tuple(rep["data_endpoints"]),
            progress_endpoint=rep["progress_endpoint"],
            timeout_s=REP_TIMEOUT_S,
        )
        channel = Channel(plan, WorkerPlace(0, index, index))
        relays = []
        for endpoint in rep.get("relay_to", ()):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 16)  # as the server's data sockets
            sock.bind(endpoint)
            relays.append(sock)
        emit("connected", index=index)
        rss, cpu0 = RssPeak(), time.process_time()
        received = chunks = wrong = 0
        while received < payload:
            chunk = channel.recv()
            n = len(chunk.data)
            view[chunk.offset : chunk.offset + n] = chunk.data
            wrong += chunk.data[0] != (chunk.offset // CHUNK_BYTES) & 0xFF
            for sock in relays:
                sock.send_multipart(frames.chunk(chunk.offset, chunk.data), copy=False)
            received += n
            chunks += 1
            channel.progress(chunks, received)
        end_time = time.time()  # the stream's end on the host's clock, which the server's end reads too
        cpu = time.process_time() - cpu0
        channel.progress(chunks, received, force=True)
        for sock in relays:
            sock.close(int(REP_TIMEOUT_S * 1e3))  # its queued chunks still go out
        channel.close(linger_ms=1000)
        emit(
            "done",
            index=index,
            received=received,
            relayed=received * len(relays),
            chunks=chunks,
            wrong_chunks=wrong,
            end_time=end_time,
            cpu_s=round(cpu, 4),
            rss_growth=rss.stop(),
        )


# -- the server's end ----------------------------------------------------------------------
class Receivers:
    """The worker processes, started once and reused by every rep (as vLLM's workers are)."""

    def __init__(self, count: int, payload: int) -> None:
        from bench.lib.procs import Worker

        self.workers = [
            Worker(["recv", "--index", str(i), "--payload", str(payload)], module="bench.weights.channel_fanout")
            for i in range(count)
        ]
        for w in self.workers:
            w.expect("ready", 60)

    def close(self) -> None:
        for w in self.workers:
            w.finish()


async def one_rep(
    ctx: zmq.asyncio.Context, directory: Path, receivers: Receivers, way: str, workers: int, payload: int, op: str
) -> dict[str, Any]:
    """One stream of `payload` bytes to `workers` workers, `way` (see the module docstring)."""
    from enginectl.server.weights.sources.channels import UpdateChannels

    layout = WorkerLayout(1, workers if way == "per_worker" else 1)
    channels = UpdateChannels(ctx, directory, op, layout)
    try:
        if way == "per_worker":
            endpoints = list(channels.data_endpoints)
        else:
            endpoints = [
                channels.data_endpoints[0],
                *(f"ipc://{directory}/{op}-relay-{i}.sock" for i in range(1, workers)),
            ]
        mine = receivers.workers[:workers]
        # Worker 0 first: in the relay it binds what the others connect to.
        for i, w in enumerate(mine):
            rep: dict[str, Any] = {"data_endpoints": endpoints, "progress_endpoint": channels.progress_endpoint}
            if way == "relay" and i == 0:
                rep["relay_to"] = endpoints[1:]
            w.send(json.dumps(rep))
            w.expect("connected", 30)
        rss, cpu0 = RssPeak(), time.process_time()
        t0, t0_wall = time.perf_counter(), time.time()
        for k in range(payload // CHUNK_BYTES):
            # A fresh chunk each time, as each arrives in its own gRPC message, dropped once sent.
            await channels.send_chunk(k * CHUNK_BYTES, (k & 0xFF).to_bytes(1, "little") * CHUNK_BYTES)
        sent_s = time.perf_counter() - t0
        ends = [await asyncio.to_thread(w.expect, "done", REP_TIMEOUT_S) for w in mine]
        cpu_s, rss_growth = time.process_time() - cpu0, rss.stop()
    finally:
        channels.close()
    return {
        "wall_s": max(e["end_time"] for e in ends) - t0_wall,
        "sent_s": sent_s,
        "server_cpu_s": cpu_s,
        "server_rss_growth": rss_growth,
        "server_bytes_sent": payload * len(channels.data_endpoints),
        "workers": [{k: v for k, v in e.items() if k != "event"} for e in ends],
    }


def schedule(rep: int) -> list[tuple[str, int]]:
    """Every (way, W) of a rep; the order reversed every other rep, so drift falls on all alike
    (the relay to 1 worker is the per-worker channel to 1: not run twice)."""
    runs = [(way, w) for w in WORKERS for way in WAYS if not (way == "relay" and w == 1)]
    return runs if rep % 2 == 0 else runs[::-1]


async def measure(payload: int, reps: int) -> dict[str, Any]:
    """`reps` reps of every (way, W) in `schedule` order, after one untimed warm-up rep each
    (the workers' first receive allocates ZMQ's buffers)."""
    receivers = Receivers(max(WORKERS), payload)
    directory = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    ctx = zmq.asyncio.Context()
    runs: dict[str, list[dict[str, Any]]] = {f"{way}_{w}": [] for way, w in schedule(0)}
    try:
        for way, w in schedule(0):
            await one_rep(ctx, directory, receivers, way, w, payload, f"warm-{way}-{w}")
        for rep in range(reps):
            for way, w in schedule(rep):
                runs[f"{way}_{w}"].append(await one_rep(ctx, directory, receivers, way, w, payload, f"{rep}-{way}-{w}"))
    finally:
        ctx.destroy(0)
        receivers.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"payload_bytes": payload, "chunk_bytes": CHUNK_BYTES, "reps": reps, "runs": summarize(runs, payload)}


def summarize(runs: dict[str, list[dict[str, Any]]], payload: int) -> dict[str, Any]:
    """Medians over reps per (way, W); a worker that got less than the payload, or a wrong
    chunk, fails the measurement."""
    out: dict[str, Any] = {}
    for key, reps in runs.items():
        for r in reps:
            bad = [w for w in r["workers"] if w["received"] != payload or w["wrong_chunks"]]
            if bad:
                raise RuntimeError(f"{key}: a worker did not get the whole stream: {bad}")
        wall = statistics.median(r["wall_s"] for r in reps)
        workers = len(reps[0]["workers"])
        out[key] = {
            "workers": workers,
            "n": len(reps),
            "wall_ms": round(wall * 1e3, 1),
            "wall_min_ms": round(min(r["wall_s"] for r in reps) * 1e3, 1),
            "gb_per_s_per_worker": round(payload / wall / 1e9, 3),
            "server_bytes_sent": reps[0]["server_bytes_sent"],
            "server_cpu_s": round(statistics.median(r["server_cpu_s"] for r in reps), 3),
            "server_rss_growth_mib": round(statistics.median(r["server_rss_growth"] for r in reps) / 2**20, 1),
            "per_worker": [
                {
                    "received": reps[0]["workers"][i]["received"],
                    "relayed": reps[0]["workers"][i]["relayed"],
                    "cpu_s": round(statistics.median(r["workers"][i]["cpu_s"] for r in reps), 3),
                    "rss_growth_mib": round(statistics.median(r["workers"][i]["rss_growth"] for r in reps) / 2**20, 1),
                }
                for i in range(workers)
            ],
        }
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    """The fan-out table (also part of the tensor_parallel phase's report)."""
    runs = res["runs"]
    base = runs["per_worker_1"]["wall_ms"]
    lines = [
        "",
        (
            f"Update channels: one rank's tensor stream ({res['payload_bytes'] / 2**20:.0f} MiB in "
            f"{res['chunk_bytes'] >> 20} MiB chunks) to W worker processes, each a real worker `Channel` "
            "copying every chunk into a buffer allocated once; the server's end a real `UpdateChannels` "
            f"(bench/weights/channel_fanout.py); medians of {res['reps']} interleaved reps. *per_worker*: a PUSH "
            "per worker, every chunk sent to each without a copy (enginectl); *relay*: one PUSH per rank, "
            "worker 0 passes every chunk on to the others. Received: per worker (every one must get the "
            "whole payload); passed on: by worker 0; RSS: peak growth during the send."
        ),
        "",
        "| way | W | wall ms (min) | / W=1 | GB/s per worker | server MiB sent | server CPU s | server RSS MiB "
        "| worker 0: CPU s, RSS MiB, MiB passed on | other workers: CPU s, RSS MiB (median of them) | "
        "MiB received per worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in runs.items():
        way = key.rsplit("_", 1)[0]
        w0, others = r["per_worker"][0], r["per_worker"][1:]
        rest = (
            f"{statistics.median(o['cpu_s'] for o in others):.3f}, "
            f"{statistics.median(o['rss_growth_mib'] for o in others):.1f}"
            if others
            else ""
        )
        received = sorted({o["received"] >> 20 for o in r["per_worker"]})
        lines.append(
            f"| {way} | {r['workers']} | {r['wall_ms']} ({r['wall_min_ms']}) | {r['wall_ms'] / base:.2f} | "
            f"{r['gb_per_s_per_worker']} | {r['server_bytes_sent'] >> 20} | {r['server_cpu_s']} | "
            f"{r['server_rss_growth_mib']} | {w0['cpu_s']}, {w0['rss_growth_mib']}, {w0['relayed'] >> 20} | "
            f"{rest} | {', '.join(map(str, received))} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.weights.channel_fanout", description=__doc__)
    parser.add_argument("mode", nargs="?", choices=("run", "recv"), default="run")
    parser.add_argument("--quick", action="store_true", help="run: 32 MiB and 2 reps (default: 256 MiB and 7 reps)")
    parser.add_argument("--index", type=int, help="recv: this worker's rank among the rank's workers")
    parser.add_argument("--payload", type=int, help="recv: the stream's bytes")
    args = parser.parse_args()
    if args.mode == "recv":
        sys.exit(report_errors(lambda: recv(args.index, args.payload)))

    def run() -> None:
        res = asyncio.run(measure((32 if args.quick else 256) << 20, 2 if args.quick else 7))
        print("\n".join(markdown(res)), file=sys.stderr, flush=True)
        emit("result", **res)

    sys.exit(report_errors(run))


if __name__ == "__main__":
    main()
