"""Weight updates at tensor parallelism 2 beside the same at 1, in one run (phase
`tensor_parallel`; bench/README.md), and the tensor stream's fan-out to a rank's workers
(bench/weights/channel_fanout.py).

Runs in two kinds of process:

- the `python -m bench` process (`phase`, `figures`, `markdown`), which only orchestrates: it
  runs `python -m bench.weights.channel_fanout` (no vLLM), builds the weights phase's synthetic
  checkpoints with the weights phase's own builder (`python -m bench.weights.clients build`,
  bench/lib/checkpoints.py), and per checkpoint starts two `enginectl serve` on it at once: one
  at TP=1 (vLLM's automatic CPU binding, as the weights phase runs it: on 2 cores the worker
  computes on core 0, core 1 is reserved; the report quotes vLLM's log) and one at TP=2
  (`--tensor-parallel-size 2 --distributed-executor-backend mp`, each worker's OpenMP threads
  on one core of its own: `VLLM_CPU_OMP_THREADS_BIND=0|1`, which the CPU build needs to start
  two workers; docs/operations.md), both with the weights phase's 64 MiB KV cache per worker;
  then `python -m bench.weights.tensor_parallel run` is the trainer;
- that trainer subprocess (`run`; torch is imported there only), speaking JSON lines
  (bench/lib/lines.py): one warm-up update of each kind on each server, not kept, then rep by
  rep UpdateWeightsFromDisk of the model directory and UpdateWeightsFromTensors of the same
  tensors (2 MiB chunks, as the weights phase), on each server, the servers' order alternating
  (ABBA) so drift falls on both alike. After each update, untimed, a full VerifyWeights on
  that server waits out the declaration's full fingerprint, which the server takes in the
  background and which would otherwise run under the next update, on the other server.

Figures (reported: on 2 shared cores both TP workers share the CPUs, and no target exists):
median time TP=2 / TP=1, per kind and checkpoint; as evidence, what every worker of rank 0
loaded in each update (`UpdateResult.ranks[0].workers`): with tensor parallelism every worker
loads every tensor, its shard of it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.checkpoints import Checkpoint, checkpoints
from bench.lib.harness import ServeProcess
from bench.lib.lines import emit, report_errors
from bench.lib.progress import log
from bench.lib.stats import median_ms
from bench.weights import channel_fanout
from bench.weights.phase import built_models, phase_medians

TP = 2
SERVERS = ("tp1", "tp2")
KINDS = ("disk", "tensors")
RPCS = {"disk": "UpdateWeightsFromDisk", "tensors": "UpdateWeightsFromTensors"}
CHUNK_BYTES = 2 * 1024 * 1024  # the tensor stream's chunks, as the weights phase sends them
BINDING_LOG = re.compile(r"local_rank=\d+, core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\]")
WARMUP = "warmup"  # the version prefix of the warm-up updates, kept out of the phase timings


# -- the orchestrator's side ----------------------------------------------------------------
def phase(quick: bool) -> dict[str, Any]:
    from bench.lib.procs import Worker

    log("tensor_parallel: the channel fan-out (no vLLM)")
    fanout = Worker([*(["--quick"] if quick else [])], module="bench.weights.channel_fanout")
    try:
        out: dict[str, Any] = {"fanout": fanout.expect("result", 300)}
    finally:
        fanout.finish()
    out["fanout"].pop("event", None)
    models = built_models("tensor_parallel", quick)
    out["checkpoints"] = {}
    for ckpt in checkpoints(quick):
        log(f"tensor_parallel: {ckpt.label} checkpoint, a TP=1 and a TP=2 server")
        out["checkpoints"][ckpt.key] = measure(ckpt, Path(models[ckpt.key]), 2 if quick else 5)
    return out


def _server(model: Path, name: str) -> ServeProcess:
    """The TP=1 or TP=2 server of `model`: model_server's flags (float32, eager, 64 MiB of KV
    cache per worker) and the directory allowed for disk updates."""
    from bench.lib.procs import model_server

    extra = ["--allow-weights-from", str(model)]
    if name == "tp2":
        extra += ["--tensor-parallel-size", str(TP), "--distributed-executor-backend", "mp"]
    server = model_server(model, extra)
    server.name = f"enginectl-{name}-{model.name}"
    server.keep_lines = True  # the "weights updated" events: where each update's time went
    if name == "tp2":  # a core per worker: the CPU build's automatic binding refuses 2 workers on 2 cores
        server.env = server.env | {
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, sorted(os.sched_getaffinity(0))[:TP]))
        }
    return server


def measure(ckpt: Checkpoint, model: Path, reps: int) -> dict[str, Any]:
    """Serve `model` at TP=1 and at TP=2 at once and run the trainer against both."""
    servers = {name: _server(model, name) for name in SERVERS}
    result, stops = side_by_side("tensor_parallel", servers, model, reps)
    return {
        **summarize(result),
        "model": str(model),
        "label": ckpt.label,
        "hidden": ckpt.hidden,
        "layers": ckpt.layers,
        "binding": {name: _binding(s) for name, s in servers.items()},
        "phases_ms": {
            name: {k: v for k, v in phase_medians(s.events()).items() if not k.startswith(WARMUP)}
            for name, s in servers.items()
        },
        "server_stops": stops,
    }


def side_by_side(
    who: str, servers: dict[str, ServeProcess], model: Path, reps: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start `servers` at once on `model`, run this module's trainer (`run`) against all of
    them, and stop them whatever happens: (the trainer's result, each server's stop). A child
    process left behind fails the phase `who`."""
    from bench.lib.procs import Worker

    t0 = time.monotonic()
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        log(
            f"{who}: servers ready after {time.monotonic() - t0:.1f}s; {reps} reps (+1 warm-up) "
            "of a disk and a tensor-stream update on each, interleaved"
        )
        targets = [arg for name, s in servers.items() for arg in ("--target", f"{name}={s.grpc_target}")]
        worker = Worker(
            ["run", *targets, "--model", str(model), "--reps", str(reps)], module="bench.weights.tensor_parallel"
        )
        try:
            result = worker.expect("result", 1800)
        finally:
            worker.finish()
    finally:
        stops = {name: server.stop() for name, server in servers.items()}
    left = {name: s for name, s in stops.items() if s.get("children_left")}
    if left:
        raise RuntimeError(f"a {who} server left children: {left}")
    result.pop("event", None)
    return result, stops


def _binding(server: ServeProcess) -> str:
    """The cores each worker computes on and those vLLM reserved, as vLLM's CPU build logs them
    at start ("OpenMP thread binding info"), and the VLLM_CPU_OMP_THREADS_BIND it was given."""
    found = [m.group(0) for line in server.lines for m in BINDING_LOG.finditer(line)]
    given = server.env.get("VLLM_CPU_OMP_THREADS_BIND", "unset (auto)")
    return f"VLLM_CPU_OMP_THREADS_BIND {given}: {'; '.join(dict.fromkeys(found)) or 'not logged'}"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per server and kind: medians of the wall time, the server's own duration and rank 0's;
    what each worker loaded; and whether every worker of every rep loaded every tensor."""
    out: dict[str, Any] = {k: result[k] for k in ("num_tensors", "payload_bytes", "reps")}
    for name in SERVERS:
        out[name] = {}
        for kind in KINDS:
            reps = result["runs"][name][kind]
            workers = [w for r in reps for w in r["workers"]]
            out[name][kind] = {
                "wall": median_ms([r["seconds"] for r in reps]),
                "server_ms": round(statistics.median(r["server_s"] for r in reps) * 1e3, 1),
                "rank_ms": round(statistics.median(r["rank_s"] for r in reps) * 1e3, 1),
                "workers": reps[-1]["workers"],  # the last rep's; `every_worker_loaded_all` covers every rep
                "every_worker_loaded_all": all(
                    w["tensors_loaded"] == result["num_tensors"] and w["weights_modified"] and not w["error_cause"]
                    for w in workers
                )
                and all(len(r["workers"]) == (TP if name == "tp2" else 1) for r in reps),
            }
    out["raw"] = result["runs"]
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def described(ck: dict[str, Any]) -> str:
    """A checkpoint's row label: its kind, tensors and size."""
    return f"{ck['label']} ({ck['num_tensors']} tensors, {ck['payload_bytes'] / 1e6:.0f} MB)"


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("tensor_parallel")
    if not res:
        return []
    out = []
    for key, ck in res["checkpoints"].items():
        for kind in KINDS:
            one, two = ck["tp1"][kind], ck["tp2"][kind]
            loaded = "every worker loaded every tensor" if two["every_worker_loaded_all"] else "**a worker did not**"
            out.append(
                {
                    "figure": f"{RPCS[kind]} at TP=2 (`mp`, a core per worker), {described(ck)}",
                    "checkpoint": key,
                    "baseline": "the same update at TP=1, same run, reps interleaved",
                    "baseline_value": one["wall"]["median_ms"],
                    "enginectl_value": two["wall"]["median_ms"],
                    "unit": "ms",
                    "ratio": _ratio(two["wall"]["median_ms"], one["wall"]["median_ms"]),
                    "target": "reported (no target; both TP workers share the 2 cores)",
                    "met": None,
                    "floor": (
                        f"rank 0 receive+load TP=2 / TP=1: {_ratio(two['rank_ms'], one['rank_ms'])}x; {loaded} "
                        f"in all {two['wall']['n']} reps"
                    ),
                }
            )
    fanout = res.get("fanout")
    if fanout:
        runs = fanout["runs"]
        one = runs["per_worker_1"]
        for workers in (2, 4):
            mine, relay = runs.get(f"per_worker_{workers}"), runs.get(f"relay_{workers}")
            if not mine:
                continue
            floor = f"server RSS growth {mine['server_rss_growth_mib']} MiB (W=1: {one['server_rss_growth_mib']} MiB)"
            if relay:
                floor += (
                    f"; a relay through worker 0 instead: {relay['wall_ms']} ms "
                    f"({_ratio(relay['wall_ms'], mine['wall_ms'])}x), worker 0 passing on "
                    f"{relay['per_worker'][0]['relayed'] >> 20} MiB"
                )
            out.append(
                {
                    "figure": (
                        f"Tensor stream ({fanout['payload_bytes'] >> 20} MiB) to the {workers} workers of a rank, "
                        "a PUSH per worker (UpdateChannels)"
                    ),
                    "baseline": "the same stream to 1 worker",
                    "baseline_value": one["wall_ms"],
                    "enginectl_value": mine["wall_ms"],
                    "unit": "ms",
                    "ratio": _ratio(mine["wall_ms"], one["wall_ms"]),
                    "target": "reported (no target)",
                    "met": None,
                    "floor": floor,
                }
            )
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("tensor_parallel")
    if not res:
        return []
    lines: list[str] = []
    for ck in res["checkpoints"].values():
        lines += _checkpoint_table(ck)
    if res.get("fanout"):
        lines += channel_fanout.markdown(res["fanout"])
    return lines


def _checkpoint_table(ck: dict[str, Any]) -> list[str]:
    lines = [
        "",
        (
            f"Tensor parallelism, {described(ck)} float32, synthetic Llama hidden {ck['hidden']}, {ck['layers']} "
            f"layers, files in page cache; a TP=1 and a TP=2 server (`mp`) at once; {ck['reps']} interleaved "
            "reps (ABBA); median ms (min-max). server: UpdateResult.duration; rank 0: its receive+load. "
            f"Cores (vLLM's log): TP=1 {ck['binding']['tp1']}; TP=2 {ck['binding']['tp2']}."
        ),
        "",
        "| update | TP=1 | TP=2 | TP=2 / TP=1 | server TP=1 / TP=2 | rank 0 TP=1 / TP=2 |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        one, two = ck["tp1"][kind], ck["tp2"][kind]
        a, b = one["wall"], two["wall"]
        lines.append(
            f"| {RPCS[kind]} | {a['median_ms']} ({a['min_ms']}-{a['max_ms']}) | "
            f"{b['median_ms']} ({b['min_ms']}-{b['max_ms']}) | {_ratio(b['median_ms'], a['median_ms'])} | "
            f"{one['server_ms']} / {two['server_ms']} | {one['rank_ms']} / {two['rank_ms']} |"
        )
    lines += [
        "",
        "What each worker of rank 0 loaded (the last rep's `UpdateResult.ranks[0].workers`; *all reps* says "
        "whether every worker of every rep loaded every tensor, modified its weights and reported no error):",
        "",
        "| server | update | worker | tensors loaded | MB loaded (`bytes_loaded`) | weights modified | error | all reps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SERVERS:
        for kind in KINDS:
            group = ck[name][kind]
            for w in group["workers"]:
                lines.append(
                    f"| {name} | {kind} | {w['worker_rank']} | {w['tensors_loaded']} / {ck['num_tensors']} | "
                    f"{w['bytes_loaded'] / 1e6:.1f} | {w['weights_modified']} | {w['error_cause'] or '-'} | "
                    f"{'yes' if group['every_worker_loaded_all'] else '**no**'} |"
                )
    lines += [
        "",
        'Where the time goes (each server\'s own phase timings, `phases_ms` of its "weights updated" '
        "lines; medians, ms):",
        "",
        "| server | update | pause | load | finish | fingerprint |",
        "|---|---|---|---|---|---|",
    ]
    for name, phases in ck["phases_ms"].items():
        for kind, p in sorted(phases.items()):
            lines.append(
                f"| {name} | {kind} | {p.get('pause', '')} | {p.get('load', '')} | {p.get('finish', '')} | "
                f"{p.get('fingerprint', '')} |"
            )
    return lines


# -- the trainer's side ---------------------------------------------------------------------
def run(targets: dict[str, str], model: Path, reps: int) -> dict[str, Any]:
    """The interleaved reps of `KINDS` on every server of `targets` (name -> gRPC target)."""
    from safetensors.torch import load_file

    from enginectl.client import TrainerClient
    from enginectl.client.trainer_tensors import named_tensors

    file = model / "model.safetensors"
    file.read_bytes()  # into the page cache
    named = named_tensors(load_file(str(file)))
    clients = {name: TrainerClient(target, timeout=600) for name, target in targets.items()}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {kind: [] for kind in KINDS} for name in targets}

    def update(name: str, kind: str, version: str) -> dict[str, Any]:
        client = clients[name]
        t0 = time.perf_counter()
        if kind == "disk":
            result = client.update_weights_from_disk(str(model), version)
        else:
            result = client.update_weights_from_tensors(named, version, chunk_bytes=CHUNK_BYTES)
        seconds = time.perf_counter() - t0
        client.verify_weights(full=True)  # untimed: the declaration's background fingerprint ends here
        (rank,) = result.ranks
        return {
            "seconds": seconds,
            "server_s": result.duration,
            "rank_s": rank.duration,
            "workers": [
                {
                    "worker_rank": w.worker_rank,
                    "tensors_loaded": w.tensors_loaded,
                    "bytes_loaded": w.bytes_loaded,
                    "weights_modified": w.weights_modified,
                    "error_cause": w.error_cause,
                }
                for w in rank.workers
            ],
        }

    try:
        for kind in KINDS:
            for name in targets:
                update(name, kind, f"{WARMUP}-{kind}-{name}")
        order = list(targets)
        for rep in range(reps):
            for kind in KINDS:
                for name in order if rep % 2 == 0 else order[::-1]:
                    runs[name][kind].append(update(name, kind, f"{kind}-{rep}"))
    finally:
        for client in clients.values():
            client.close()
    payload = sum(t.numel() * t.element_size() for _, t in named)
    return {"num_tensors": len(named), "payload_bytes": payload, "reps": reps, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.weights.tensor_parallel")
    parser.add_argument("mode", choices=("run",))
    parser.add_argument("--target", action="append", default=[], help="NAME=HOST:PORT, once per server")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    targets = dict(t.split("=", 1) for t in args.target)
    sys.exit(report_errors(lambda: emit("result", **run(targets, args.model, args.reps))))


if __name__ == "__main__":
    main()
