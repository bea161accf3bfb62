"""Rollouts over gRPC (bench/README.md, figure 7; phase `grpc_rollouts`): Generate of vLLM's
gRPC engine service (`vllm.grpc.engine.VllmEngine`, which enginectl serves on its control port;
docs/rollouts.md) against vLLM's own HTTP `/v1/completions`, on one enginectl server.

Runs in the `python -m bench` process, which only orchestrates: the streams run in
`python -m bench.lib.clients rollouts --via http|grpc` subprocesses (bench/lib/clients.py).

Each round starts one driver: S concurrent streaming requests of N tokens (same prompt as
text, `ignore_eos`, greedy), looping; once every stream has its first token, a fixed window
runs, then the driver stops. Per round: tokens/s over the window, the time to first token of
every request sent in it, and the server's main-process CPU time (where the HTTP API, the
control plane and vLLM's output processing run; the EngineCore is a child process). Rounds go
http, grpc, http, grpc, ... so that machine noise falls on both alike. Figures: grpc/http of
the median tokens/s over rounds (target >= 0.9) and of the p50 of the TTFT samples pooled over
rounds (target <= 1.1). GetWeightVersion p99 during gRPC Generate streams, the other half of
the phase, is bench/run.py's `phase_rollouts` with the gRPC driver.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.lib.harness import ServeProcess
from bench.lib.procs import rollout_driver
from bench.lib.progress import log
from bench.lib.stats import ratio, summarize_ms

TOKENS_PER_S_TARGET = 0.9  # grpc tokens/s / http tokens/s >=
TTFT_P50_TARGET = 1.1  # grpc TTFT p50 / http TTFT p50 <=
VIAS = ("http", "grpc")


def _round(eng: ServeProcess, via: str, streams: int, tokens: int, window: float) -> tuple[dict[str, Any], list[float]]:
    """One driver over `via` for `window` seconds of load: its result and its TTFT samples (s)."""
    driver = rollout_driver(eng, streams, tokens, window + 150, via=via, ttft_samples=True)
    try:
        started = driver.expect("started", 150)
        cpu0, t0 = eng.cpu_seconds(), time.monotonic()
        time.sleep(window)  # the measurement window (the load runs meanwhile)
        cpu1, t1 = eng.cpu_seconds(), time.monotonic()
        driver.send("stop")
        res = driver.expect("result", 90)
    finally:
        driver.finish()
    samples: list[float] = res.pop("ttft_s")
    res.pop("event", None)
    res["started_after_s"] = started["after_s"]
    window_tokens = (res["tokens_per_s"] or 0) * (t1 - t0)
    res["server_cpu_ms_per_1k_tokens"] = round((cpu1 - cpu0) * 1e6 / window_tokens, 1) if window_tokens else None
    return res, samples


def phase(eng: ServeProcess, streams: int, tokens: int, quick: bool) -> dict[str, Any]:
    """gRPC Generate vs HTTP /v1/completions on `eng`, in interleaved rounds."""
    rounds, window = (2, 2.0) if quick else (5, 5.0)
    out: dict[str, Any] = {via: {"rounds": []} for via in VIAS}
    ttft: dict[str, list[float]] = {via: [] for via in VIAS}
    for rnd in range(rounds):
        for via in VIAS:
            log(f"grpc_rollouts: round {rnd + 1}/{rounds}, {via}, {streams} streams x {tokens} tokens, {window}s")
            res, samples = _round(eng, via, streams, tokens, window)
            out[via]["rounds"].append(res)
            ttft[via] += samples
    for via in VIAS:
        rec, done = out[via], out[via]["rounds"]
        # Median over rounds: one round hit by a neighbour's burst moves nothing.
        rec["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] or 0.0 for r in done), 1)
        rec["ttft"] = summarize_ms(ttft[via])  # pooled over rounds
        for key in ("server_cpu_ms_per_1k_tokens", "client_cpu_ms_per_1k_tokens"):
            cpu = [r[key] for r in done if r[key]]
            rec[key] = round(statistics.median(cpu), 1) if cpu else None
        for key in ("completions", "errors", "tokens_short"):
            rec[key] = sum(r[key] for r in done)
    out["_config"] = {"streams": streams, "max_tokens": tokens, "rounds": rounds, "window_s": window}
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    """The per-via table of the Generate-vs-HTTP half (its figures are in bench/run_report.py)."""
    gen = (results.get("grpc_rollouts") or {}).get("generate")
    if not gen:
        return []
    c = gen["_config"]
    lines = [
        "",
        f"Rollouts, gRPC Generate (control port) vs HTTP /v1/completions ({c['streams']} streams x "
        f"{c['max_tokens']} tokens, same prompt; {c['rounds']} interleaved rounds of {c['window_s']}s; "
        "tokens/s: median of rounds; TTFT: pooled over rounds):",
        "",
        "| via | tokens/s | per round | TTFT n | TTFT p50 ms | p90 ms | p99 ms | completion p50 s | "
        "server CPU ms/1k tokens | client CPU ms/1k tokens | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for via in VIAS:
        rec, t = gen[via], gen[via]["ttft"]
        per_round = ", ".join(str(round(r["tokens_per_s"] or 0)) for r in rec["rounds"])
        completion = statistics.median(r["completion_s_p50"] or 0.0 for r in rec["rounds"])
        lines.append(
            f"| {via} | {rec['tokens_per_s']:.0f} | {per_round} | {t.get('n')} | {t.get('p50_ms')} | "
            f"{t.get('p90_ms')} | {t.get('p99_ms')} | {completion:.3f} | {rec['server_cpu_ms_per_1k_tokens']} | "
            f"{rec['client_cpu_ms_per_1k_tokens']} | {rec['errors']} |"
        )
    lines.append("")
    lines.append(
        f"grpc/http: tokens/s {ratio(gen['grpc']['tokens_per_s'], gen['http']['tokens_per_s'])}, "
        f"TTFT p50 {ratio(gen['grpc']['ttft'].get('p50_ms'), gen['http']['ttft'].get('p50_ms'))}. "
        "HTTP opens a connection per request (as bench/lib/clients.py always has); gRPC keeps one "
        "channel per stream. Server CPU: the enginectl main process (HTTP API, control plane, vLLM's "
        "output processing; not the EngineCore); client CPU: the driver process. Both share the 2 cores."
    )
    if gen["http"]["tokens_short"] or gen["grpc"]["tokens_short"]:
        lines.append(
            f"Tokens missing from completed requests' counts (HTTP counts one token per SSE event): "
            f"http {gen['http']['tokens_short']}, grpc {gen['grpc']['tokens_short']}; tokens/s undercounts them."
        )
    return lines
