"""Behind the SMG gateway (bench/README.md, figure 9; phase `gateway`;
docs/rollouts.md, "Behind the SMG gateway"): rollouts through SMG, the HTTP RL routes' pause + resume,
and how long SMG takes to show a declared version.

Runs in the `python -m bench` process, which only orchestrates. bench/run.py starts SMG
(bench/gateway/smg_process.py) before the shared `enginectl serve` and gives that server
`--gateway <smg url>`, so the figures are measured on the one server the other phases use,
registered the way a user's is. The load runs in subprocesses: rollout drivers
(`python -m bench.lib.clients rollouts`) and `python -m bench.gateway.clients pause|label-lag`.

1. Rollouts: the same 4 streams x 64 tokens (same prompt, `ignore_eos`, greedy) three ways, in
   interleaved rounds (http, grpc, smg, http, ...): vLLM's streaming `/v1/completions` on the
   server's HTTP port, Generate of vLLM's gRPC engine service on its control port (as
   bench/rollouts/phase.py), and `/v1/completions` on SMG, which routes it to that same
   control port. Both HTTP drivers count tokens by the stream's usage (SMG merges tokens into
   one event until their text is whole). Ratios vs vLLM HTTP, reported; vs gRPC Generate too.
2. Pause + resume: `POST /pause?mode=keep` + `POST /resume` on the HTTP port vs the gRPC pair,
   interleaved, p50 ratio (target <= 1.2).
3. Declaration -> SMG label: SetWeightVersion, then `GET /v1/rl/workers` on SMG until the
   server's row names it; p50 / p99 (target p99 <= 1000 ms).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.gateway.smg_process import SmgProcess
from bench.lib.harness import ServeProcess
from bench.lib.procs import Worker
from bench.lib.progress import log
from bench.lib.stats import ratio, summarize_ms

PAUSE_HTTP_VS_GRPC_TARGET = 1.2  # HTTP RL routes pause + resume p50 / the gRPC pair's <=
LABEL_LAG_P99_TARGET_MS = 1000.0  # declaration answered -> SMG's row names it, p99 <=
VIAS = ("http", "grpc", "smg")
REGISTERED_TIMEOUT_S = 60.0


def worker_url(server: ServeProcess) -> str:
    """The server's worker URL in SMG (what `--gateway` registers: common/gateway.py)."""
    return f"grpc://{server.grpc_target}"


def _driver(server: ServeProcess, smg: SmgProcess, via: str, streams: int, tokens: int, max_s: float) -> Worker:
    args = ["rollouts", "--streams", str(streams), "--max-tokens", str(tokens), "--max-seconds", str(max_s)]
    args += ["--ttft-samples"]
    if via == "grpc":
        return Worker([*args, "--via", "grpc", "--grpc", server.grpc_target])
    hostport = smg.hostport if via == "smg" else f"127.0.0.1:{server.http_port}"
    return Worker([*args, "--http", hostport, "--model", server.served_model, "--usage"])


def _round(
    server: ServeProcess, smg: SmgProcess, via: str, streams: int, tokens: int, window: float
) -> tuple[dict[str, Any], list[float]]:
    """One driver over `via` for `window` seconds of load: its result and its TTFT samples (s)."""
    driver = _driver(server, smg, via, streams, tokens, window + 150)
    try:
        started = driver.expect("started", 150)
        time.sleep(window)  # the measurement window (the load runs meanwhile)
        driver.send("stop")
        res = driver.expect("result", 90)
    finally:
        driver.finish()
    samples: list[float] = res.pop("ttft_s")
    res.pop("event", None)
    res["started_after_s"] = started["after_s"]
    return res, samples


def measure_rollouts(server: ServeProcess, smg: SmgProcess, streams: int, tokens: int, quick: bool) -> dict[str, Any]:
    rounds, window = (2, 2.0) if quick else (5, 5.0)
    out: dict[str, Any] = {via: {"rounds": []} for via in VIAS}
    ttft: dict[str, list[float]] = {via: [] for via in VIAS}
    for rnd in range(rounds):
        for via in VIAS:
            log(f"gateway: rollouts round {rnd + 1}/{rounds}, {via}, {streams} streams x {tokens} tokens, {window}s")
            res, samples = _round(server, smg, via, streams, tokens, window)
            out[via]["rounds"].append(res)
            ttft[via] += samples
    for via in VIAS:
        rec, done = out[via], out[via]["rounds"]
        # Median over rounds: one round hit by a neighbour's burst moves nothing.
        rec["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] or 0.0 for r in done), 1)
        rec["ttft"] = summarize_ms(ttft[via])  # pooled over rounds
        for key in ("completions", "errors", "tokens_short"):
            rec[key] = sum(r[key] for r in done)
    out["_config"] = {"streams": streams, "max_tokens": tokens, "rounds": rounds, "window_s": window}
    return out


def phase(server: ServeProcess, smg: SmgProcess, streams: int, tokens: int, quick: bool) -> dict[str, Any]:
    """Every figure of the family on `server`, registered with `smg` (bench/run.py started both)."""
    url = worker_url(server)
    t0 = time.monotonic()
    smg.wait_for(lambda rows: any(r["url"] == url and r["health"] == "ready" for r in rows), REGISTERED_TIMEOUT_S)
    out: dict[str, Any] = {"smg": smg.url, "worker_url": url, "ready_in_smg_after_s": round(time.monotonic() - t0, 3)}
    out["rollouts"] = measure_rollouts(server, smg, streams, tokens, quick)

    reps = 50 if quick else 300
    log(f"gateway: pause + resume, HTTP RL routes vs gRPC, {reps} interleaved reps")
    pause = Worker(
        ["pause", "--target", server.grpc_target, "--http-port", str(server.http_port), "--reps", str(reps)],
        module="bench.gateway.clients",
    )
    try:
        out["pause"] = pause.expect("result", 300)
    finally:
        pause.finish()

    n = 10 if quick else 50
    log(f"gateway: declaration -> SMG label lag, {n} declarations")
    lag = Worker(
        ["label-lag", "--target", server.grpc_target, "--smg", smg.url, "--url", url, "--n", str(n)],
        module="bench.gateway.clients",
    )
    try:
        out["label_lag"] = lag.expect("result", 60 + 12 * n)
    finally:
        lag.finish()
    return out


# -- report ----------------------------------------------------------------------------------
def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    gw = results.get("gateway")
    if not gw:
        return []
    ro = gw["rollouts"]
    http, grpc, smg = ro["http"], ro["grpc"], ro["smg"]
    what = f"{ro['_config']['streams']} streams x {ro['_config']['max_tokens']} tokens"
    pause, lag = gw["pause"], gw["label_lag"]
    p99 = lag["lag"].get("p99_ms")
    pause_ratio = ratio(pause["http"].get("p50_ms"), pause["grpc"].get("p50_ms"))
    return [
        {
            "figure": f"Rollouts through SMG (/v1/completions on SMG -> control port), tokens/s, {what}",
            "baseline": "vLLM HTTP /v1/completions tokens/s",
            "baseline_value": http["tokens_per_s"],
            "enginectl_value": smg["tokens_per_s"],
            "unit": "tokens/s",
            "ratio": ratio(smg["tokens_per_s"], http["tokens_per_s"]),
            "target": "reported",
            "met": None,
            "floor": f"vs gRPC Generate straight to the control port: {ratio(smg['tokens_per_s'], grpc['tokens_per_s'])}x",
        },
        {
            "figure": f"Rollouts through SMG, time to first token p50, {what}",
            "baseline": "vLLM HTTP /v1/completions TTFT p50",
            "baseline_value": http["ttft"].get("p50_ms"),
            "enginectl_value": smg["ttft"].get("p50_ms"),
            "unit": "ms",
            "ratio": ratio(smg["ttft"].get("p50_ms"), http["ttft"].get("p50_ms")),
            "target": "reported",
            "met": None,
            "floor": "vs gRPC Generate straight to the control port: "
            f"{ratio(smg['ttft'].get('p50_ms'), grpc['ttft'].get('p50_ms'))}x",
        },
        {
            "figure": "HTTP RL routes POST /pause?mode=keep + POST /resume p50, keep-alive",
            "baseline": "PauseGeneration(KEEP) + ResumeGeneration p50, keep-alive channel",
            "baseline_value": pause["grpc"].get("p50_ms"),
            "enginectl_value": pause["http"].get("p50_ms"),
            "unit": "ms",
            "ratio": pause_ratio,
            "target": f"<= {PAUSE_HTTP_VS_GRPC_TARGET}",
            "met": pause_ratio is not None and pause_ratio <= PAUSE_HTTP_VS_GRPC_TARGET,
        },
        {
            "figure": f"Declaration -> SMG weight_version label, p99 of {lag['declarations']}",
            "baseline": "—",
            "baseline_value": None,
            "enginectl_value": p99,
            "unit": "ms",
            "ratio": None,
            "target": f"p99 <= {LABEL_LAG_P99_TARGET_MS:.0f} ms",
            "met": p99 is not None and lag["lost"] == 0 and p99 <= LABEL_LAG_P99_TARGET_MS,
            "floor": f"p50 {lag['lag'].get('p50_ms')} ms; lost {lag['lost']}",
        },
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    gw = results.get("gateway")
    if not gw:
        return []
    ro, c = gw["rollouts"], gw["rollouts"]["_config"]
    lines = [
        "",
        f"Behind SMG ({gw['smg']}; the server registered itself with `--gateway`): rollouts, "
        f"{c['streams']} streams x {c['max_tokens']} tokens, same prompt; {c['rounds']} interleaved rounds of "
        f"{c['window_s']}s (tokens/s: median of rounds; TTFT: pooled):",
        "",
        "| via | tokens/s | per round | vs http | TTFT n | TTFT p50 ms | p90 ms | p99 ms | vs http p50 | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "http": "vLLM HTTP /v1/completions",
        "grpc": "gRPC Generate (control port)",
        "smg": "SMG /v1/completions -> control port",
    }
    http = ro["http"]
    for via in VIAS:
        rec, t = ro[via], ro[via]["ttft"]
        per_round = ", ".join(str(round(r["tokens_per_s"] or 0)) for r in rec["rounds"])
        lines.append(
            f"| {names[via]} | {rec['tokens_per_s']:.0f} | {per_round} | "
            f"{ratio(rec['tokens_per_s'], http['tokens_per_s'])} | {t.get('n')} | {t.get('p50_ms')} | "
            f"{t.get('p90_ms')} | {t.get('p99_ms')} | {ratio(t.get('p50_ms'), http['ttft'].get('p50_ms'))} | "
            f"{rec['errors']} |"
        )
    pause, lag = gw["pause"], gw["label_lag"]
    lines += [
        "",
        f"Pause + resume ({pause['reps']} interleaved reps, ms) and declaration -> SMG label "
        f"({lag['declarations']} declarations, one at a time, ms; lost {lag['lost']}; "
        f"median polls of /v1/rl/workers per declaration {lag['polls_median']}):",
        "",
        "| measure | n | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in (
        ("HTTP POST /pause?mode=keep + /resume", pause["http"]),
        ("gRPC PauseGeneration(KEEP) + ResumeGeneration", pause["grpc"]),
        ("label lag, from SetWeightVersion's answer", lag["lag"]),
        ("label lag, from SetWeightVersion sent", lag["lag_from_call"]),
    ):
        lines.append(
            f"| {name} | {s.get('n')} | {s.get('p50_ms')} | {s.get('p90_ms')} | {s.get('p99_ms')} | {s.get('max_ms')} |"
        )
    return lines
