"""The measuring client of phase `multinode` (bench/multinode/phase.py), speaking JSON lines
(bench/lib/lines.py): `python -m bench.multinode.clients run --target NAME=GRPC,HTTP ...`.

Against each target, after one warm-up of each kind (not kept), rep by rep with the targets'
order alternating (ABBA, so drift falls on both alike): READS GetWeightVersion calls, each
timed; a PauseGeneration + ResumeGeneration round trip (every rank's EngineCore is paused and
resumed: vLLM's utility calls, over TCP to node B); an UpdateWeightsFromTensors of the served
model's own tensors (every worker of every rank loads them: rank 1's over the update's TCP
channels on the two-node engine), then an untimed full VerifyWeights, which waits out the
declaration's background fingerprint so it does not run under the next rep.

Then, per target, an FPM window: a StreamForwardPassMetrics subscriber (heartbeats included)
while each rank generates (`/inference/v1/generate` with vLLM's X-data-parallel-rank header);
per rank, the latency of every sample (arrival wall time minus the publisher's emit_time:
node B's clock is this host's, its namespaces share the kernel's) and its delivery (samples
received / the span of the publisher's counter_ids, plus what the stream says it missed).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from bench.lib.lines import emit, report_errors
from bench.lib.stats import median_ms, summarize_ms

READS = 50  # GetWeightVersion calls per rep and target
GENERATE_TOKENS = 16


def _generate(http_url: str, rank: int, stop: threading.Event, errors: list[str]) -> None:
    body = json.dumps({"token_ids": [1, 43, 375, 82], "sampling_params": {"max_tokens": GENERATE_TOKENS}}).encode()
    while not stop.is_set():
        request = urllib.request.Request(
            f"{http_url}/inference/v1/generate",
            data=body,
            headers={"content-type": "application/json", "X-data-parallel-rank": str(rank)},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
        except OSError as exc:
            errors.append(repr(exc))
            return


def fpm_window(grpc_target: str, http_url: str, ranks: int, seconds: float) -> dict[str, Any]:
    from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
    from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc

    arrivals: list[tuple[int, int, float]] = []  # (dp_rank, counter_id, latency s)
    missed = [0]
    channel = grpc.insecure_channel(grpc_target)
    call = svc_grpc.ForwardPassMetricsServiceStub(channel).StreamForwardPassMetrics(
        svc_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True)
    )
    subscribed = threading.Event()

    def read() -> None:
        try:
            for message in call:
                subscribed.set()
                now = time.time()
                missed[0] += message.batch.missed if message.HasField("batch") else 0
                for s in message.batch.samples:
                    arrivals.append((s.dp_rank, s.counter_id, now - s.emit_time.ToNanoseconds() / 1e9))
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not subscribed.wait(30):
        raise RuntimeError("the FPM stream sent nothing in 30 s")
    stop, errors = threading.Event(), []
    loads = [threading.Thread(target=_generate, args=(http_url, r, stop, errors), daemon=True) for r in range(ranks)]
    start = len(arrivals)
    for t in loads:
        t.start()
    time.sleep(seconds)  # the measurement window (load runs meanwhile)
    stop.set()
    for t in loads:
        t.join(180)
    call.cancel()
    reader.join(30)
    channel.close()
    if errors:
        raise RuntimeError(f"generation failed: {errors[:3]}")
    window = arrivals[start:]
    out: dict[str, Any] = {"missed": missed[0]}
    for rank in range(ranks):
        mine = [(c, lat) for r, c, lat in window if r == rank]
        counters = sorted({c for c, _ in mine})
        span = counters[-1] - counters[0] + 1 if counters else 0
        out[str(rank)] = {
            "samples": len(mine),
            "delivered": round(len(counters) / span, 4) if span else None,
            "latency": summarize_ms([lat for _, lat in mine]),
        }
    return out


def cmd_run(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from enginectl.client import TrainerClient

    targets = dict(t.split("=", 1) for t in args.target)
    state = dict(load_file(str(Path(args.model) / "model.safetensors")))
    runs: dict[str, dict[str, list[float]]] = {n: {"read": [], "pause_resume": [], "tensors": []} for n in targets}
    clients = {n: TrainerClient(t.split(",")[0], timeout=300.0) for n, t in targets.items()}
    ranks = {n: len(c.get_server_info().ranks) for n, c in clients.items()}
    try:
        for rep in range(-1, args.reps):  # -1: the warm-up, not kept
            names = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for name in names:
                c, kept = clients[name], runs[name] if rep >= 0 else {k: [] for k in runs[name]}
                for _ in range(READS):
                    t0 = time.perf_counter()
                    c.get_weight_version()
                    kept["read"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.pause_generation("keep")
                c.resume_generation()
                kept["pause_resume"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                result = c.update_weights_from_tensors(state, f"bench-{name}-{rep}", timeout=300)
                kept["tensors"].append(time.perf_counter() - t0)
                if [r.tensors_loaded for r in result.ranks] != [len(state)] * ranks[name]:
                    raise RuntimeError(f"{name}: not every rank loaded every tensor: {result.ranks}")
                c.verify_weights(full=True)
        fpm = {n: fpm_window(*t.split(","), ranks[n], args.window) for n, t in targets.items()}
    finally:
        for c in clients.values():
            c.close()
    emit(
        "result",
        reps=args.reps,
        num_tensors=len(state),
        payload_bytes=sum(t.numel() * t.element_size() for t in state.values()),
        ranks=ranks,
        read={n: summarize_ms(r["read"]) for n, r in runs.items()},
        pause_resume={n: median_ms(r["pause_resume"]) for n, r in runs.items()},
        tensors={n: median_ms(r["tensors"]) for n, r in runs.items()},
        fpm=fpm,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multinode.clients")
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--target", action="append", required=True, help="NAME=GRPC_TARGET,HTTP_URL (repeatable)")
    run.add_argument("--model", required=True)
    run.add_argument("--reps", type=int, default=10)
    run.add_argument("--window", type=float, default=15.0)
    args = parser.parse_args(argv)
    return report_errors(lambda: cmd_run(args))


if __name__ == "__main__":
    sys.exit(main())
