"""`python -m bench`: GetWeightVersion latency, latency under rollouts and throughput
(bench/README.md, figures 1-3), measured side by side against baselines in one run; writes
bench/results/.

Runs in its own process, which only orchestrates: servers and load generators are separate
subprocesses (see bench/lib/: harness.py, procs.py, servers.py, clients.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import phase as fleet
from bench.fleet_hosts import phase as fleet_hosts
from bench.fpm import phase as fpm
from bench.fpm import publish as fpm_publish
from bench.gateway import phase as gateway
from bench.gateway.smg_process import SmgProcess
from bench.lib.harness import ServeProcess
from bench.lib.procs import (
    HTTP_STARTUP_LINE,
    Worker,
    baseline_server,
    enginectl_server,
    http_get_status,
    rollout_driver,
    vllm_server,
    wait_http_ready,
)
from bench.lib.progress import log
from bench.lib.provenance import machine_info, repo_info
from bench.multinode import phase as multinode
from bench.rollouts import phase as rollouts_grpc
from bench.run_report import TARGETS, figures, markdown
from bench.weights import load_check, tensor_parallel
from bench.weights import phase as weights

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The phases whose baselines are vLLM's own HTTP routes, on a plain vLLM API server
# (bench/lib/procs.py vllm_server): `enginectl serve` mounts enginectl's routes on those paths.
VLLM_PHASES = ("latency", "weights")
PHASES = (
    "latency",
    "rollouts",
    "throughput",
    "grpc_rollouts",
    "gateway",
    "fpm",
    "fpm_publish",
    "weights",
    "fleet",
    "tensor_parallel",
    "load_check",
    "multinode",
    "fleet_hosts",
)
DIAGNOSTIC_VARIANTS = ("bare-uvloop", "intercepted-nolog", "intercepted", "controlplane")


@dataclass(frozen=True)
class Config:
    latency_samples: int
    latency_warmup: int
    latency_block: int
    latency_max_s: float
    rollout_samples: int
    rollout_streams: int
    rollout_tokens: int
    rollout_max_s: float
    tp_clients: int
    tp_procs: int
    tp_warmup_s: float
    tp_window_s: float
    tp_rounds: int

    @classmethod
    def make(cls, quick: bool) -> Config:
        if quick:
            return cls(300, 50, 50, 40.0, 300, 4, 64, 40.0, 16, 2, 0.5, 1.5, 1)
        return cls(2000, 200, 100, 120.0, 2000, 4, 64, 120.0, 16, 2, 1.0, 4.0, 3)


def median(values: Iterable[float]) -> float:
    return round(statistics.median(list(values)), 3)


# -- phases --------------------------------------------------------------------------------
def run_latency_worker(targets: dict[str, str], cfg: Config, samples: int, max_s: float) -> dict:
    args = [
        "latency",
        "--samples",
        str(samples),
        "--warmup",
        str(cfg.latency_warmup),
        "--block",
        str(cfg.latency_block),
        "--max-seconds",
        str(max_s),
    ]
    for name, spec in targets.items():
        args += ["--target", f"{name}={spec}"]
    worker = Worker(args)
    try:
        return worker.expect("result", max_s + 120)
    finally:
        worker.finish()


def phase_latency(servers: dict[str, ServeProcess], http_targets: dict[str, str], cfg: Config) -> dict:
    targets = {name: f"grpc:{srv.grpc_target}" for name, srv in servers.items()}
    targets.update(http_targets)
    log(f"latency: {cfg.latency_samples} samples x {len(targets)} targets, interleaved blocks")
    res = run_latency_worker(targets, cfg, cfg.latency_samples, cfg.latency_max_s)
    return {"targets": res["targets"], "elapsed_s": res["elapsed_s"], "truncated": res["truncated"]}


def phase_rollouts(
    servers: dict[str, ServeProcess], http_targets: dict[str, str], cfg: Config, via: str = "http"
) -> dict:
    """GetWeightVersion p99 idle, under rollouts (HTTP /v1/completions, or gRPC Generate on the
    control port with `via="grpc"`), and idle again."""
    eng = servers["enginectl"]
    targets = {"enginectl": f"grpc:{eng.grpc_target}", "bare": f"grpc:{servers['bare'].grpc_target}"}
    first_http = next(iter(http_targets))
    targets[first_http] = http_targets[first_http]
    n, max_s = cfg.rollout_samples, cfg.rollout_max_s
    log(f"rollouts: idle p99, {n} samples")
    idle = run_latency_worker(targets, cfg, n, max_s)
    what = "gRPC Generate" if via == "grpc" else "/v1/completions"
    log(f"rollouts: {cfg.rollout_streams} streaming {what} x {cfg.rollout_tokens} tokens, looping")
    driver = rollout_driver(eng, cfg.rollout_streams, cfg.rollout_tokens, max_s + 150, via=via)
    try:
        started = driver.expect("started", 150)
        log(f"rollouts: load running; p99 under load, {n} samples")
        loaded = run_latency_worker(targets, cfg, n, max_s)
        driver.send("stop")
        load = driver.expect("result", 90)
    finally:
        driver.finish()
    log(f"rollouts: idle again, {n} samples")
    idle_after = run_latency_worker(targets, cfg, n, max_s)
    return {
        "idle": idle["targets"],
        "loaded": loaded["targets"],
        "idle_after": idle_after["targets"],
        "loaded_truncated": loaded["truncated"],
        "load": {**load, "started_after_s": started["after_s"]},
        "http_target": first_http,
    }


def run_throughput_once(name: str, spec: str, server: ServeProcess, cfg: Config) -> dict:
    per_proc = cfg.tp_clients // cfg.tp_procs
    workers = [
        Worker(
            [
                "throughput",
                "--target",
                f"{name}={spec}",
                "--clients",
                str(per_proc),
                "--warmup-seconds",
                str(cfg.tp_warmup_s),
                "--seconds",
                str(cfg.tp_window_s),
                "--max-seconds",
                "120",
            ]
        )
        for _ in range(cfg.tp_procs)
    ]
    try:
        for w in workers:
            w.expect("ready", 120)
        cpu0 = server.cpu_seconds()
        for w in workers:
            w.send("go")
        results = [w.expect("result", cfg.tp_window_s + 60) for w in workers]
        cpu1 = server.cpu_seconds()
    finally:
        for w in workers:
            w.finish()
    requests = sum(r["requests"] for r in results)
    rps = sum(r["rps"] for r in results)
    window = max(r["window_s"] for r in results)
    return {
        "rps": round(rps, 1),
        "requests": requests,
        "errors": sum(r["errors"] for r in results),
        "server_cpu_s": round(cpu1 - cpu0, 3),
        "server_cpu_util": round((cpu1 - cpu0) / window, 3),
        "server_cpu_us_per_req": round((cpu1 - cpu0) / requests * 1e6, 1) if requests else None,
        "latency_p50_ms": round(sum(r["latency"].get("p50_ms", 0) for r in results) / len(results), 4),
        "latency_p99_ms": max(r["latency"].get("p99_ms", 0) for r in results),
    }


def phase_throughput(servers: dict[str, ServeProcess], http_targets: dict[str, str], cfg: Config) -> dict:
    eng = servers["enginectl"]
    runs: list[tuple[str, str, ServeProcess]] = [
        (name, f"grpc:{srv.grpc_target}", srv) for name, srv in servers.items()
    ]
    first_http = next(iter(http_targets))
    runs.append((first_http, http_targets[first_http], eng))
    out: dict[str, dict] = {name: {"rounds": []} for name, _, _ in runs}
    for rnd in range(cfg.tp_rounds):
        for name, spec, srv in runs:
            log(
                f"throughput: round {rnd + 1}/{cfg.tp_rounds}, {name}, {cfg.tp_clients} clients "
                f"in {cfg.tp_procs} processes, {cfg.tp_window_s}s window"
            )
            out[name]["rounds"].append(run_throughput_once(name, spec, srv, cfg))
    for rec in out.values():
        rounds = rec["rounds"]
        # Medians over the interleaved rounds: one round hit by a neighbour's burst moves nothing.
        rec["rps"] = median(r["rps"] for r in rounds)
        cpu = [r["server_cpu_us_per_req"] for r in rounds if r["server_cpu_us_per_req"]]
        rec["server_cpu_us_per_req"] = median(cpu) if cpu else None
        rec["server_cpu_util"] = median(r["server_cpu_util"] for r in rounds)
        rec["errors"] = sum(r["errors"] for r in rounds)
        rec["latency_p50_ms"] = median(r["latency_p50_ms"] for r in rounds)
    out["_config"] = {
        "clients": cfg.tp_clients,
        "processes": cfg.tp_procs,
        "window_s": cfg.tp_window_s,
        "rounds": cfg.tp_rounds,
        "http_target": first_http,
        "note": "server CPU for HTTP rows is the whole enginectl process",
    }
    return out


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples and shorter windows (smoke run)")
    parser.add_argument(
        "--only", choices=PHASES, action="append", help="run only this phase (repeatable); default: all"
    )
    parser.add_argument(
        "--no-diagnostics",
        action="store_true",
        help="skip the extra baseline variants (" + ", ".join(DIAGNOSTIC_VARIANTS) + ")",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument(
        "--rollout-streams", type=int, default=None, help="concurrent rollout streams during the p99 phase (default 4)"
    )
    args = parser.parse_args(argv)
    phases = [p for p in PHASES if not args.only or p in args.only]
    cfg = Config.make(args.quick)
    if args.rollout_streams is not None:
        cfg = dataclasses.replace(cfg, rollout_streams=args.rollout_streams)
    results: dict = {
        "mode": "quick" if args.quick else "full",
        "phases": phases,
        "config": cfg.__dict__,
        "targets": TARGETS,
        "machine": machine_info(),
        "repo": repo_info(),
        "notes": [],
    }

    want_variants = not args.no_diagnostics and any(p in phases for p in ("latency", "throughput"))
    # The gateway phase measures the shared server behind SMG, registered as a user's is
    # (`--gateway`); SMG then health-checks it once a second, through every phase.
    smg = SmgProcess() if "gateway" in phases else None
    servers: dict[str, ServeProcess] = {
        "bare": baseline_server("bare"),
        **({v: baseline_server(v) for v in DIAGNOSTIC_VARIANTS} if want_variants else {}),
        "enginectl": enginectl_server(["--gateway", smg.url] if smg else []),
    }
    vllm = vllm_server() if any(p in phases for p in VLLM_PHASES) else None
    stops: list[dict] = []
    t0 = time.monotonic()
    try:
        if smg:
            log("starting smg (the gateway phase)")
            smg.start()
        log(f"starting servers: {', '.join(servers)}")
        eng = servers["enginectl"]
        startup_line = eng.watch(HTTP_STARTUP_LINE)
        for srv in servers.values():
            srv.start()
        if vllm:  # started with the others, waited for after them
            log("starting a plain vLLM API server (the HTTP baselines of figures 1 and 6)")
            vllm.start()
        for name, srv in list(servers.items()):
            try:
                srv.wait_ready()
            except RuntimeError as err:
                if name not in DIAGNOSTIC_VARIANTS:
                    raise
                stops.append(srv.stop())
                del servers[name]
                results["notes"].append(
                    f"diagnostic variant {name} did not start; skipped: {str(err).splitlines()[-1][:200]}"
                )
                log(f"{name} did not start; skipped")
        results["http_ready"] = wait_http_ready(eng, startup_line)
        log(
            f"servers ready after {time.monotonic() - t0:.1f}s; enginectl grpc {eng.grpc_target}, "
            f"http {eng.http_port} (HTTP probes after `serving`: {results['http_ready']['probes']})"
        )
        if results["http_ready"]["probes"] > 1:
            results["notes"].append(
                f"enginectl logged `serving` before vLLM's HTTP API accepted connections "
                f"({results['http_ready']['probes'] - 1} refused probe(s)); the bench waits for it."
            )

        if vllm:
            vllm.wait_ready()
            results["vllm_server"] = {"http_port": vllm.http_port, "ready_after_s": vllm.serving["ready_after_s"]}
            log(f"vLLM API server ready (http {vllm.http_port})")

        # Rollouts and throughput list an HTTP route of the enginectl server beside their figures.
        http_targets: dict[str, str] = {}
        if http_get_status(eng.http_port, "/weight_info") == 200:
            results["http_route"] = "/weight_info"
            http_targets["http"] = f"http:127.0.0.1:{eng.http_port}/weight_info"
            http_targets["http-version"] = f"http:127.0.0.1:{eng.http_port}/version"
            results["notes"].append(
                "On `enginectl serve`, /weight_info is enginectl's own HTTP route (docs/http_routes.md): "
                "rollouts and throughput list it, and vLLM's /version (no engine), for reference."
            )
        else:
            results["http_route"] = "/version"
            http_targets["http"] = f"http:127.0.0.1:{eng.http_port}/version"
            results["notes"].append("/weight_info not reachable on vLLM's HTTP API; HTTP baseline is /version.")

        # The latency figure's HTTP baseline: the plain vLLM server's own /weight_info.
        latency_http: dict[str, str] = {}
        if vllm and http_get_status(vllm.http_port, "/weight_info") == 200:
            results["http_route"] = "/weight_info"
            latency_http["http"] = f"http:127.0.0.1:{vllm.http_port}/weight_info"
            latency_http["http-version"] = f"http:127.0.0.1:{vllm.http_port}/version"
            results["notes"].append(
                "The latency figure's HTTP baseline is vLLM's own /weight_info (rl router, needs "
                "VLLM_SERVER_DEV_MODE=1; it asks the engine core process over ZMQ) on a plain vLLM API "
                "server with the same model and flags (bench/lib/procs.py vllm_server): `enginectl serve` "
                "mounts enginectl's route on that path (docs/http_routes.md). /version on the same server "
                "(no engine) is shown for reference."
            )
        elif vllm:
            results["http_route"] = "/version"
            latency_http["http"] = f"http:127.0.0.1:{vllm.http_port}/version"
            results["notes"].append("/weight_info not reachable on the vLLM API server; HTTP baseline is /version.")

        grpc_servers = {k: v for k, v in servers.items() if k != "enginectl"}
        ordered = {"bare": grpc_servers.pop("bare"), **grpc_servers, "enginectl": eng}
        if "latency" in phases:
            results["latency"] = phase_latency(ordered, latency_http, cfg)
        if "rollouts" in phases:
            results["rollouts"] = phase_rollouts(ordered, http_targets, cfg)
        if "throughput" in phases:
            results["throughput"] = phase_throughput(ordered, http_targets, cfg)
        if "grpc_rollouts" in phases:  # vLLM's gRPC engine service on the control port
            streams, tokens = cfg.rollout_streams, cfg.rollout_tokens
            results["grpc_rollouts"] = {
                "generate": rollouts_grpc.phase(eng, streams, tokens, args.quick),
                "p99": phase_rollouts(ordered, http_targets, cfg, via="grpc"),
            }
        if "gateway" in phases and smg:  # the same server behind SMG
            results["gateway"] = gateway.phase(eng, smg, cfg.rollout_streams, cfg.rollout_tokens, args.quick)
        if "fpm" in phases:
            results["fpm_latency"] = fpm.phase_latency(eng, args.quick)
            results["fpm_fanin"] = fpm.phase_fanin(eng, args.quick, servers["bare"])
        if "fpm_publish" in phases:  # its own in-process engine, in a worker subprocess
            results["fpm_publish"] = fpm_publish.phase(args.quick)
        if "weights" in phases:  # its own server on a bigger synthetic model
            assert vllm is not None
            results["weights"] = weights.phase(args.quick, vllm.http_port)
        if "fleet" in phases:  # its own two servers on the same synthetic model
            results["fleet"] = fleet.phase(args.quick)
        if "tensor_parallel" in phases:  # its own TP=1 and TP=2 servers on the same synthetic models
            results["tensor_parallel"] = tensor_parallel.phase(args.quick)
        if "load_check" in phases:  # its own --load-check full and finite servers on the same synthetic models
            results["load_check"] = load_check.phase(args.quick)
        if "multinode" in phases:  # its own DP=2 engines: one host, and rank 1 on node B
            results["multinode"] = multinode.phase(args.quick)
        if "fleet_hosts" in phases:  # its own four servers: two here, one on each of two other hosts
            results["fleet_hosts"] = fleet_hosts.phase(args.quick)
        results["enginectl_log_lines"] = eng.lines_seen
    finally:
        if vllm:
            stops.append(vllm.stop())
        for name in reversed(list(servers)):
            stops.append(servers[name].stop())
        if smg:  # after the server, which deregisters from it on SIGTERM
            stops.append(smg.stop())
    results["stops"] = stops
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    leftovers = [s for s in stops if s.get("children_left") or s.get("exit_code") not in (0, None)]
    if leftovers:
        results["notes"].append(f"unclean server stops: {leftovers}")
    results["figures"] = figures(results)

    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(results)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "latest.md").write_text(md)
    print(md)
    log(f"done in {results['elapsed_s']}s; wrote {args.out / 'latest.json'} and latest.md")
    return 0
