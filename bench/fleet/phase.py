"""A fleet update, one broadcast to 2 servers vs the same update to 1 (bench/README.md, figure 8).

Runs in the `python -m bench` process, which only orchestrates: a worker subprocess builds
(once, under bench/.cache) the weights bench's "few large" checkpoint (bench/lib/checkpoints.py);
two `enginectl serve` subprocesses serve it at once, with the weights bench's small KV cache
(bench/weights/phase.py); `python -m bench.fleet.clients run` is the trainer (docs/weights.md, "The
fleet"): per rep, interleaved, `Fleet([A, B])` and `Fleet([A])` each stage the checkpoint's
tensors from one broadcast through their own gloo group and commit it strictly (pause all,
commit each, resume all), and a raw gloo broadcast of the same tensors goes to 2 receiver
processes and to 1 (the physical floor of the ratio on this machine). The servers' own
"weights staged" and "weights updated" log lines and each commit's UpdateResult say how long
each server's stage and commit (and its load and finish phases) took. Figure: median end-to-end time with 2 servers / with 1, target <= 1.15x.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.lib.checkpoints import checkpoints
from bench.lib.harness import ServeProcess
from bench.lib.progress import log
from bench.lib.stats import median_ms

TARGET = 1.15  # end to end, 2 servers / 1 server <=
SERVERS = 2
KINDS = ("fleet_2", "fleet_1")


def phase(quick: bool) -> dict[str, Any]:
    from bench.lib.procs import Worker

    log("fleet: building the few-large checkpoint (once, under bench/.cache)")
    builder = Worker(["build", *(["--quick"] if quick else [])], module="bench.fleet.clients")
    try:
        model = Path(builder.expect("result", 900)["model"])
    finally:
        builder.finish()
    ckpt = next(c for c in checkpoints(quick) if c.key == "few_large")
    out = measure(model, 3 if quick else 11)
    out.update(model=str(model), label=ckpt.label, hidden=ckpt.hidden, layers=ckpt.layers)
    return out


def _server(model: Path, index: int) -> ServeProcess:
    """Fleet server `index`. Each gets a core of its own for its worker's compute, as two
    engines sharing a host need (docs/operations.md, "Several engines on one CPU host"): left
    to vLLM's automatic binding, every engine on the host binds its worker to the same first
    core."""
    from bench.lib.procs import model_server

    server = model_server(model)
    server.name = f"enginectl-fleet-{index}"
    server.keep_lines = True  # each stage's and commit's own duration (its log lines)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= SERVERS:
        server.env = server.env | {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index])}
    return server


def measure(model: Path, reps: int) -> dict[str, Any]:
    """Serve `model` twice at once and run the trainer against both; both servers are
    stopped whatever happens, and a child process left behind fails the phase."""
    from bench.lib.procs import Worker

    servers = [_server(model, i) for i in range(SERVERS)]
    log(f"fleet: starting {SERVERS} servers on {model.name}")
    t0 = time.monotonic()
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        log(
            f"fleet: servers ready after {time.monotonic() - t0:.1f}s; {reps} reps (+1 warm-up) of a "
            "2-server and a 1-server update and a raw gloo broadcast to 2 and to 1, interleaved"
        )
        targets = [arg for s in servers for arg in ("--target", s.grpc_target)]
        worker = Worker(["run", *targets, "--model", str(model), "--reps", str(reps)], module="bench.fleet.clients")
        try:
            result = worker.expect("result", 900)
        finally:
            worker.finish()
    finally:
        stops = [server.stop() for server in servers]
    left = [s for s in stops if s.get("children_left")]
    if left:
        raise RuntimeError(f"a fleet server left children: {left}")
    result.pop("event", None)
    _join_server_timings(result["reps"], servers)
    return {**summarize(result), "servers": [s.grpc_target for s in servers], "server_stops": stops}


def _join_server_timings(reps: dict[str, list[dict[str, Any]]], servers: list[ServeProcess]) -> None:
    """Each update rep gets the slowest server's stage seconds, from the servers' "weights
    staged" log lines (server/weights/update/staging.py, by staged set), and every server's commit
    phases, from its "weights updated" line (server/weights/update/run.py, by version)."""
    staged: dict[tuple[str, str], float] = {}
    phases: dict[tuple[str, str], dict[str, float]] = {}
    for server in servers:
        for e in server.events():
            if e.get("event") == "weights staged":
                staged[(server.grpc_target, str(e.get("name")))] = float(e["seconds"])
            elif e.get("event") == "weights updated" and isinstance(e.get("phases_ms"), dict):
                phases[(server.grpc_target, str(e.get("version")))] = e["phases_ms"]
    for kind in KINDS:
        for rep in reps[kind]:
            rep["server_stage_s"] = max(staged[(t, name)] for t, name in rep["staged"].items())
            mine = {t: phases[(t, rep["version"])] for t in rep["staged"]}
            rep["commit_phases_ms"] = mine
            for name in ("load", "finish"):
                rep[f"commit_{name}_s"] = max(float(p.get(name, 0.0)) for p in mine.values()) / 1e3


MEASURES = {  # a rep's field: what it times
    "total_s": "end to end: stage_broadcast + strict commit, from the call to every server committed",
    "stage_s": "stage_broadcast call: one broadcast, every server staged",
    "commit_s": "commit call (strict: pause all, commit each, resume all)",
    "server_stage_s": "server's own stage (slowest server's `weights staged` seconds)",
    "server_commit_s": "server's own commit (slowest server's UpdateResult.duration)",
    "commit_load_s": "server's commit, load phase (slowest server's, `phases_ms` of its `weights updated` line)",
    "commit_finish_s": "server's commit, finishing round trip (cache reset, fingerprint, version stamp, resume)",
}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    reps = result["reps"]
    out: dict[str, Any] = {
        kind: {field: median_ms([r[field] for r in reps[kind]]) for field in MEASURES} for kind in KINDS
    }
    out.update(
        raw_gloo_2=median_ms([r["total_s"] for r in reps["raw_2"]]),
        raw_gloo_1=median_ms([r["total_s"] for r in reps["raw_1"]]),
        num_tensors=result["num_tensors"],
        payload_bytes=result["payload_bytes"],
        rank_offsets=result["rank_offsets"],
        raw=reps,
    )
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def _what(res: dict[str, Any]) -> str:
    return f"{res['label']} ({res['num_tensors']} tensors, {res['payload_bytes'] / 1e6:.0f} MB)"


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("fleet")
    if not res:
        return []
    two, one = res["fleet_2"]["total_s"]["median_ms"], res["fleet_1"]["total_s"]["median_ms"]
    ratio = _ratio(two, one)
    raw = _ratio(res["raw_gloo_2"]["median_ms"], res["raw_gloo_1"]["median_ms"])
    return [
        {
            "figure": f"Fleet update (stage_broadcast + strict commit), one broadcast to 2 servers, {_what(res)}",
            "baseline": "the same update to 1 server (a Fleet of 1, its own group)",
            "baseline_value": one,
            "enginectl_value": two,
            "unit": "ms",
            "ratio": ratio,
            "target": f"<= {TARGET}",
            "met": ratio <= TARGET,
            "floor_value": raw,
            "floor": f"raw gloo broadcast of the same tensors to 2 receivers / to 1: {raw}x",
        }
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("fleet")
    if not res:
        return []
    two, one = res["fleet_2"], res["fleet_1"]
    lines = [
        "",
        (
            f"Fleet update, {_what(res)} float32, synthetic Llama hidden {res['hidden']}, {res['layers']} "
            f"layers; {SERVERS} `enginectl serve` on the same host; {two['total_s']['n']} interleaved reps "
            "(median ms, min-max):"
        ),
        "",
        "| measure | fleet of 2 | fleet of 1 | 2 / 1 |",
        "|---|---|---|---|",
    ]
    for field, what in MEASURES.items():
        a, b = two[field], one[field]
        lines.append(
            f"| {what} | {a['median_ms']} ({a['min_ms']}-{a['max_ms']}) | "
            f"{b['median_ms']} ({b['min_ms']}-{b['max_ms']}) | {_ratio(a['median_ms'], b['median_ms'])} |"
        )
    r2, r1 = res["raw_gloo_2"], res["raw_gloo_1"]
    lines += [
        f"| floor: raw gloo broadcast of the same tensors, to 2 receiver processes / to 1 | "
        f"{r2['median_ms']} ({r2['min_ms']}-{r2['max_ms']}) | {r1['median_ms']} ({r1['min_ms']}-{r1['max_ms']}) | "
        f"{_ratio(r2['median_ms'], r1['median_ms'])} |",
        "",
        "The fleet of 1 is the first server alone, through a group of its own. A raw broadcast ends with an "
        "allreduce every receiver enters once it has every tensor.",
    ]
    return lines
