"""FPM figures (bench/README.md, figure 4): scheduler -> planner latency p99 and fan-in throughput with 8
subscribers. Called by bench/run.py (phase `fpm`) with the enginectl server it started.

Runs in the `python -m bench` process, which only orchestrates: publishers and subscribers
are `python -m bench.fpm_clients` subprocesses (see that module).

- latency: the real path. Rollout streams on vLLM's HTTP API make the engine's scheduler
  step; each step's sample goes EngineCore publisher -> ZMQ -> relay -> gRPC stream -> a
  subscriber process, which records receive time minus the sample's `emit_time` (end of the
  step, same host clock). Target p99 < 5 ms.
- fan-in: 2 publisher processes (real ZMQ PUBs on the relay's ipc endpoint, 4 ranks each)
  offer a fixed total rate for a window; 8 subscribers in 2 processes each count what they
  receive and what they are told they missed. A rate passes when every subscriber got every
  sample (none missed, none out of order); its delivered rate is samples / (last receipt -
  first send). Target: >= 50,000 samples/s passes.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import psutil

from bench.harness import ServeProcess
from bench.procs import Worker, rollout_driver

LATENCY_P99_TARGET_MS = 5.0
FANIN_TARGET = 50_000
SUBSCRIBERS = 8
SUB_PROCS = 2
PUB_PROCS = 2


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def relay_endpoint(srv: ServeProcess) -> str:
    """The relay's ipc endpoint: the unix socket the server process bound in its private
    `enginectl-fpm-*` directory (also in its `fpm relay listening` log line, long scrolled
    out of the bench's tail by now)."""
    for conn in psutil.Process(srv.pid).net_connections(kind="unix"):
        if "enginectl-fpm-" in conn.laddr and conn.laddr.endswith("/fpm.sock"):
            return f"ipc://{conn.laddr}"
    raise RuntimeError("enginectl has no FPM relay socket")


def _worker(args: list[str]) -> Worker:
    return Worker(args, module="bench.fpm_clients")


def phase_latency(eng: ServeProcess, quick: bool) -> dict[str, Any]:
    seconds = 4.0 if quick else 12.0
    streams = 2
    sub = _worker(["subscribe", "--target", eng.grpc_target, "--latency", "--max-seconds", str(seconds + 240)])
    driver = None
    try:
        sub.expect("ready", 60)
        log(f"fpm latency: {streams} rollout streams for {seconds:.0f}s; engine step samples to 1 subscriber")
        driver = rollout_driver(eng, streams, 64, seconds + 150)
        driver.expect("started", 150)
        time.sleep(seconds)  # the measurement window (load runs meanwhile)
        driver.send("stop")
        load = driver.expect("result", 90)
        sub.send("stop")
        result = sub.expect("result", 60)
    finally:
        if driver is not None:
            driver.finish()
        sub.finish()
    return {
        "streams": streams,
        "window_s": seconds,
        "latency": result["latency"],
        "tokens_per_s": load.get("tokens_per_s"),
        "subscriber": result["subscribers"][0],
    }


def _fanin_once(eng: ServeProcess, endpoint: str, rate: float, seconds: float) -> dict[str, Any]:
    per_pub = int(rate * seconds / PUB_PROCS)
    total = per_pub * PUB_PROCS
    tag = f"{int(rate)}-{time.monotonic_ns() % 10**6}"
    workers = [f"bench-{tag}-p{i}" for i in range(PUB_PROCS)]
    probes = [f"probe-{w}" for w in workers]
    subs = [
        _worker(
            [
                "subscribe",
                "--target",
                eng.grpc_target,
                "--subscribers",
                str(SUBSCRIBERS // SUB_PROCS),
                "--expect",
                str(total),
                "--max-seconds",
                str(seconds + 120),
                *[x for w in workers for x in ("--worker", w)],
                *[x for p in probes if i == 0 for x in ("--probe", p)],
            ]
        )
        for i in range(SUB_PROCS)
    ]
    pubs = [
        _worker(
            [
                "publish",
                "--endpoint",
                endpoint,
                "--worker",
                w,
                "--probe",
                p,
                "--rate",
                str(rate / PUB_PROCS),
                "--count",
                str(per_pub),
            ]
        )
        for w, p in zip(workers, probes, strict=True)
    ]
    try:
        for w in subs + pubs:
            w.expect("ready", 60)
        for _ in probes:  # every publisher's frames reach the relay
            subs[0].expect("probe_seen", 60)
        for p in pubs:
            p.send("go")
        sent = [p.expect("result", seconds + 120) for p in pubs]
        results = [s.expect("result", seconds + 120) for s in subs]
    finally:
        for w in subs + pubs:
            w.finish()
    per_sub = [r for res in results for r in res["subscribers"]]
    t0 = min(s["t0_wall"] for s in sent)
    delivered = [s["received"] / (s["last_at"] - t0) if s["last_at"] else 0.0 for s in per_sub]
    ok = all(s["received"] == total and s["missed"] == 0 and s["out_of_order"] == 0 for s in per_sub)
    return {
        "offered_rate": rate,
        "samples": total,
        "publish_rate": round(sum(s["rate"] for s in sent), 1),
        "zero_loss": ok,
        "delivered_rate_min": round(min(delivered), 1),
        "delivered_rate_max": round(max(delivered), 1),
        "received_min": min(s["received"] for s in per_sub),
        "missed_max": max(s["missed"] for s in per_sub),
        "out_of_order": sum(s["out_of_order"] for s in per_sub),
    }


def phase_fanin(eng: ServeProcess, quick: bool) -> dict[str, Any]:
    endpoint = relay_endpoint(eng)
    seconds = 2.0 if quick else 5.0
    rates = [50_000.0] if quick else [25_000.0, 50_000.0, 75_000.0, 100_000.0]
    runs = []
    for rate in rates:
        log(f"fpm fan-in: {rate:.0f} samples/s offered for {seconds:.0f}s, {SUBSCRIBERS} subscribers")
        runs.append(_fanin_once(eng, endpoint, rate, seconds))
        log(f"fpm fan-in: {runs[-1]}")
    passing = [r for r in runs if r["zero_loss"]]
    best = max(passing, key=lambda r: r["delivered_rate_min"]) if passing else None
    return {
        "subscribers": SUBSCRIBERS,
        "publishers": PUB_PROCS,
        "window_s": seconds,
        "runs": runs,
        "best_zero_loss": best,
    }


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for the summary table: absolute targets (no baseline exists for these)."""
    out = []
    lat = results.get("fpm_latency")
    if lat:
        p99 = lat["latency"].get("p99_ms")
        out.append(
            {
                "figure": f"FPM scheduler -> planner latency p99 ({lat['streams']} rollout streams)",
                "baseline": "—",
                "baseline_value": None,
                "enginectl_value": p99,
                "unit": "ms",
                "ratio": "—",
                "target": f"< {LATENCY_P99_TARGET_MS} ms",
                "met": None if p99 is None else p99 < LATENCY_P99_TARGET_MS,
            }
        )
    fan = results.get("fpm_fanin")
    if fan:
        best = fan["best_zero_loss"]
        value = best["delivered_rate_min"] if best else 0.0
        out.append(
            {
                "figure": f"FPM fan-in throughput, {fan['subscribers']} subscribers, zero loss",
                "baseline": "—",
                "baseline_value": None,
                "enginectl_value": value,
                "unit": "samples/s",
                "ratio": "—",
                "target": f">= {FANIN_TARGET} samples/s",
                "met": bool(best) and best["offered_rate"] >= FANIN_TARGET,
            }
        )
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lat = results.get("fpm_latency")
    if lat:
        s = lat["latency"]
        title = (
            f"FPM latency, EngineCore step -> subscriber ({lat['streams']} rollout streams, "
            f"{lat['tokens_per_s']} tokens/s, {lat['window_s']}s; ms):"
        )
        row = (
            f"| {s.get('n')} | {s.get('p50_ms')} | {s.get('p90_ms')} | {s.get('p99_ms')} | "
            f"{s.get('p999_ms')} | {s.get('max_ms')} |"
        )
        lines += ["", title, "", "| n | p50 | p90 | p99 | p99.9 | max |", "|---|---|---|---|---|---|", row]
    fan = results.get("fpm_fanin")
    if fan:
        title = (
            f"FPM fan-in ({fan['publishers']} publisher processes x 4 ranks, {fan['subscribers']} "
            f"subscribers in {SUB_PROCS} processes, {fan['window_s']}s per rate; samples/s):"
        )
        header = (
            "| offered | published | delivered (slowest sub) | delivered (fastest sub) | zero loss | "
            "max missed | out of order |"
        )
        lines += ["", title, "", header, "|---|---|---|---|---|---|---|"]
        for r in fan["runs"]:
            lines.append(
                f"| {r['offered_rate']:.0f} | {r['publish_rate']:.0f} | {r['delivered_rate_min']:.0f} | "
                f"{r['delivered_rate_max']:.0f} | {'yes' if r['zero_loss'] else '**no**'} | "
                f"{r['missed_max']} | {r['out_of_order']} |"
            )
    return lines
