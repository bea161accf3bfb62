"""FPM figures (bench/README.md, figure 4): scheduler -> planner latency p99 and fan-in throughput with 8
subscribers. Called by bench/run.py (phase `fpm`) with the enginectl server it started.

Runs in the `python -m bench` process, which only orchestrates: publishers and subscribers
are `python -m bench.fpm.clients` subprocesses (see that module).

- latency: the real path. Rollout streams on vLLM's HTTP API make the engine's scheduler
  step; each step's sample goes EngineCore publisher -> ZMQ -> relay -> gRPC stream -> a
  subscriber process, which records receive time minus the sample's `emit_time` (end of the
  step, same host clock). Target p99 < 5 ms.
- fan-in: 2 publisher processes (real ZMQ PUBs on the relay's ipc endpoint, 4 ranks each)
  offer a fixed total rate for a window; 8 subscribers in 2 processes each count what they
  receive and what they are told they missed. A rate passes when every subscriber got every
  sample (none missed, none out of order); its delivered rate is samples / (last receipt -
  first send). Rates rise until one fails. Target: >= 50,000 samples/s passes.
- overload: the capacity is the best passing rate's delivered rate; then twice that is
  offered the same way while `python -m bench.fpm.clients rpc-probe` calls GetWeightVersion
  on the same server every 2 ms (its p99 then, against the same probe idle just before).
  Targets: the slowest subscriber's delivered rate >= 0.8 x capacity (no collapse), and
  every subscriber's `missed` equal to exactly the samples it did not receive. Then the same
  overload again, probing a bare grpc.aio server in a process of its own instead: the
  latency the machine's load alone adds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psutil

from bench.lib.harness import ServeProcess
from bench.lib.procs import Worker, rollout_driver
from bench.lib.progress import log

LATENCY_P99_TARGET_MS = 5.0
FANIN_TARGET = 50_000
OVERLOAD_FACTOR = 2.0  # offered / capacity in the overload row
OVERLOAD_TARGET = 0.8  # delivered (slowest subscriber) / capacity >=
SUBSCRIBERS = 8
SUB_PROCS = 2
PUB_PROCS = 2


def relay_endpoint(srv: ServeProcess) -> str:
    """The relay's ipc endpoint: the unix socket the server process bound in its private
    `enginectl-fpm-*` directory (also in its `fpm relay listening` log line, long scrolled
    out of the bench's tail by now)."""
    for conn in psutil.Process(srv.pid).net_connections(kind="unix"):
        if "enginectl-fpm-" in conn.laddr and conn.laddr.endswith("/fpm.sock"):
            return f"ipc://{conn.laddr}"
    raise RuntimeError("enginectl has no FPM relay socket")


def _worker(args: list[str]) -> Worker:
    return Worker(args, module="bench.fpm.clients")


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


def _fanin_once(
    eng: ServeProcess, endpoint: str, rate: float, seconds: float, rpc_probes: Sequence[Worker] = ()
) -> dict[str, Any]:
    """One fan-in run at `rate`; with `rpc_probes`, their GetWeightVersion latencies from `go`
    until every subscriber is done are in the result's `rpc` (a list, in their order)."""
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
        for probe in rpc_probes:
            probe.send("start")
        sent = [p.expect("result", seconds + 120) for p in pubs]
        results = [s.expect("result", seconds + 120) for s in subs]
        for probe in rpc_probes:
            probe.send("stop")
        rpc = [probe.expect("result", 60) for probe in rpc_probes]
    finally:
        for w in subs + pubs:
            w.finish()
    per_sub = [r for res in results for r in res["subscribers"]]
    t0 = min(s["t0_wall"] for s in sent)
    delivered = [s["received"] / (s["last_at"] - t0) if s["last_at"] else 0.0 for s in per_sub]
    ok = all(s["received"] == total and s["missed"] == 0 and s["out_of_order"] == 0 for s in per_sub)
    last = max((s["last_at"] for s in per_sub if s["last_at"]), default=t0)
    out = {
        "offered_rate": rate,
        "samples": total,
        "publish_rate": round(sum(s["rate"] for s in sent), 1),
        "zero_loss": ok,
        "delivered_rate_min": round(min(delivered), 1),
        "delivered_rate_max": round(max(delivered), 1),
        "received_min": min(s["received"] for s in per_sub),
        "missed_max": max(s["missed"] for s in per_sub),
        "out_of_order": sum(s["out_of_order"] for s in per_sub),
        # Over all subscribers: what they were told they missed, and what they did not get.
        "missed_total": sum(s["missed"] for s in per_sub),
        "not_delivered_total": sum(total - s["received"] for s in per_sub),
        "missed_exact": all(s["missed"] == total - s["received"] for s in per_sub),
        "last_receipt_s": round(last - t0, 2),
    }
    if rpc_probes:
        out["rpc"] = [{"latency": r["latency"], "errors": r["errors"]} for r in rpc]
    return out


def phase_fanin(eng: ServeProcess, quick: bool, bare: ServeProcess | None = None) -> dict[str, Any]:
    endpoint = relay_endpoint(eng)
    seconds = 2.0 if quick else 5.0
    rates = (
        [50_000.0] if quick else [25_000.0, 50_000.0, 75_000.0, 100_000.0, 150_000.0, 200_000.0, 250_000.0, 300_000.0]
    )
    runs = []
    for rate in rates:
        log(f"fpm fan-in: {rate:.0f} samples/s offered for {seconds:.0f}s, {SUBSCRIBERS} subscribers")
        runs.append(_fanin_once(eng, endpoint, rate, seconds))
        log(f"fpm fan-in: {runs[-1]}")
        if not runs[-1]["zero_loss"]:
            break  # past capacity: the overload row measures what happens there
    passing = [r for r in runs if r["zero_loss"]]
    best = max(passing, key=lambda r: r["delivered_rate_min"]) if passing else None
    return {
        "subscribers": SUBSCRIBERS,
        "publishers": PUB_PROCS,
        "window_s": seconds,
        "runs": runs,
        "best_zero_loss": best,
        "overload": phase_overload(eng, endpoint, runs, best, seconds, bare),
    }


def phase_overload(
    eng: ServeProcess,
    endpoint: str,
    runs: list[dict[str, Any]],
    best: dict[str, Any] | None,
    seconds: float,
    bare: ServeProcess | None = None,
) -> dict[str, Any]:
    """OVERLOAD_FACTOR x capacity offered, with GetWeightVersion probed meanwhile and idle.
    Given `bare`, the same overload is offered again while a bare grpc.aio server in a process
    of its own is probed instead: what that load costs a server that does no FPM work. (Not at
    once: the second probe and its server take enough of two cores to halve what the relay
    delivers.)"""
    # Capacity: the best zero-loss delivered rate (or, if no rate passed, the best delivered).
    capacity = best["delivered_rate_min"] if best else max(r["delivered_rate_min"] for r in runs)
    offered = round(OVERLOAD_FACTOR * capacity, -3)
    targets = [eng] + ([bare] if bare is not None else [])
    probes = [
        _worker(["rpc-probe", "--target", t.grpc_target, "--max-seconds", str(4 * seconds + 600)]) for t in targets
    ]
    try:
        for probe in probes:
            probe.expect("ready", 60)
        log(f"fpm overload: GetWeightVersion idle for {seconds:.0f}s")
        for probe in probes:
            probe.send("start")
        time.sleep(seconds)  # the idle window (the probes call meanwhile)
        for probe in probes:
            probe.send("stop")
        idles = [probe.expect("result", 60) for probe in probes]
        log(f"fpm overload: {offered:.0f} samples/s offered ({OVERLOAD_FACTOR:g}x capacity {capacity:.0f})")
        run = _fanin_once(eng, endpoint, offered, seconds, rpc_probes=probes[:1])
        if bare is not None:
            log("fpm overload: the same again, probing the bare server")
            bare_rpc = _fanin_once(eng, endpoint, offered, seconds, rpc_probes=probes[1:])["rpc"][0]
    finally:
        for probe in probes:
            probe.finish()
    idle, rpc = idles[0], run.pop("rpc")[0]
    p99_idle, p99_loaded = idle["latency"].get("p99_ms"), rpc["latency"].get("p99_ms")
    out = {
        "capacity": capacity,
        "capacity_zero_loss": best is not None,
        "factor": OVERLOAD_FACTOR,
        **run,
        "delivered_vs_capacity": round(run["delivered_rate_min"] / capacity, 3) if capacity else None,
        "rpc_idle": idle["latency"],
        "rpc_overload": rpc["latency"],
        "rpc_errors": idle["errors"] + rpc["errors"],
        "rpc_p99_vs_idle": round(p99_loaded / p99_idle, 2) if p99_idle and p99_loaded else None,
    }
    if bare is not None:
        out["bare_rpc_idle"], out["bare_rpc_overload"] = idles[1]["latency"], bare_rpc["latency"]
    log(f"fpm overload: {out}")
    return out


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
    over = (fan or {}).get("overload")
    if over:
        ratio = over["delivered_vs_capacity"]
        out.append(
            {
                "figure": f"FPM overload: delivered (slowest of {fan['subscribers']}) at {over['factor']:g}x "
                f"capacity offered, missed exact",
                "baseline": "capacity (best zero-loss rate)",
                "baseline_value": over["capacity"],
                "enginectl_value": over["delivered_rate_min"],
                "unit": "samples/s",
                "ratio": ratio,
                "target": f">= {OVERLOAD_TARGET}",
                "met": ratio is not None and ratio >= OVERLOAD_TARGET and over["missed_exact"],
            }
        )
        rpc_row = {
            "figure": "GetWeightVersion p99 during the FPM overload (reported)",
            "baseline": "same probe, idle",
            "baseline_value": over["rpc_idle"].get("p99_ms"),
            "enginectl_value": over["rpc_overload"].get("p99_ms"),
            "unit": "ms",
            "ratio": over["rpc_p99_vs_idle"],
            "target": "—",
            "met": None,
        }
        if "bare_rpc_overload" in over:
            rpc_row["floor"] = (
                f"a bare grpc.aio server in its own process, under the same overload: "
                f"{over['bare_rpc_overload'].get('p99_ms')} ms (idle {over['bare_rpc_idle'].get('p99_ms')} ms)"
            )
        out.append(rpc_row)
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
    over = (fan or {}).get("overload")
    if over:
        cap = "best zero-loss rate" if over["capacity_zero_loss"] else "no rate passed zero loss: best delivered"
        idle, loaded = over["rpc_idle"], over["rpc_overload"]
        lines += [
            "",
            f"FPM overload ({over['factor']:g}x capacity; capacity {over['capacity']:.0f} samples/s = {cap}; "
            f"{over['samples']} samples; GetWeightVersion every 2 ms on the same server, idle just before):",
            "",
            "| offered | published | delivered (slowest sub) | / capacity | missed (all subs) | "
            "not delivered (all subs) | exact | last receipt | GetWeightVersion p50 / p99 idle | "
            "p50 / p99 overload | p99 ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {over['offered_rate']:.0f} | {over['publish_rate']:.0f} | {over['delivered_rate_min']:.0f} | "
            f"{over['delivered_vs_capacity']} | {over['missed_total']} | {over['not_delivered_total']} | "
            f"{'yes' if over['missed_exact'] else '**no**'} | {over['last_receipt_s']} s | "
            f"{idle.get('p50_ms')} / {idle.get('p99_ms')} ms | {loaded.get('p50_ms')} / {loaded.get('p99_ms')} ms | "
            f"{over['rpc_p99_vs_idle']} |",
        ]
        if "bare_rpc_overload" in over:
            bare_idle, bare_loaded = over["bare_rpc_idle"], over["bare_rpc_overload"]
            lines += [
                "",
                "A bare grpc.aio server in a process of its own (bench/lib/servers.py), probed the same way "
                "while the same overload is offered to enginectl again: p50 / p99 "
                f"{bare_idle.get('p50_ms')} / {bare_idle.get('p99_ms')} ms idle, "
                f"{bare_loaded.get('p50_ms')} / {bare_loaded.get('p99_ms')} ms during the overload: what the "
                "machine's load costs a server that does no FPM work.",
            ]
    return lines
