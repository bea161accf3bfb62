"""Weight updates and pause/resume (bench/README.md, figure 6), each against its baseline and
its physical floor in one run, on two checkpoints.

Runs in the `python -m bench` process, which only orchestrates: a worker subprocess builds
(once, under bench/.cache, never committed) two synthetic float32 Llamas of about 200 MB
(bench/lib/checkpoints.py: "few large", 39 tensors; "many small", 489 tensors shaped like a real
Llama's); then, per checkpoint, an `enginectl serve` subprocess serves it
(VLLM_SERVER_DEV_MODE=1 for vLLM's /collective_rpc route) and `python -m bench.weights.clients
run` measures every figure, its baseline and the floors (bench/weights/floors.py) interleaved,
rep by rep, on that server and the same bytes; then bench/staging/phase.py measures two-phase
updates (stage, commit, discard) on the same server. The pause row's baseline is vLLM's own
/pause and /resume on the run's plain vLLM API server (bench/lib/procs.py vllm_server), idle
like ours: `enginectl serve` mounts enginectl's routes on those paths (docs/http_routes.md).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.lib.checkpoints import Checkpoint, checkpoints
from bench.lib.progress import log
from bench.staging import phase as staging
from bench.weights.transfer import transfer_rows

PAUSE_TARGET_FLOORS = 1.5  # pause + resume within 1.5x two engine round trips
TARGETS = {"disk": 0.9, "gloo": 0.9, "nccl": 0.9, "tensors": 0.8, "ipc": 0.9}
# The floor of an update that moves bytes like a raw transport and then loads them: that
# transport with the in-memory reload running beside it (bench/weights/floors.py).
BESIDE = {"gloo": "raw_gloo_beside_reload", "tensors": "raw_grpc_stream_beside_reload"}


def phase(quick: bool, vllm_http_port: int) -> dict[str, Any]:
    """`vllm_http_port`: the HTTP port of the run's plain vLLM API server, the pause row's baseline."""
    models = built_models("weights", quick)
    out: dict[str, Any] = {"checkpoints": {}}
    for ckpt in checkpoints(quick):
        log(f"weights: {ckpt.label} checkpoint, its own server")
        out["checkpoints"][ckpt.key] = measure(ckpt, Path(models[ckpt.key]), quick, vllm_http_port)
    return out


def built_models(who: str, quick: bool) -> dict[str, str]:
    """The synthetic checkpoints' model directories by key, built once under bench/.cache by
    `python -m bench.weights.clients build` (bench/lib/checkpoints.py); `who` names the phase."""
    from bench.lib.procs import Worker

    log(f"{who}: building the weights phase's synthetic checkpoints (once, under bench/.cache)")
    builder = Worker(["build", *(["--quick"] if quick else [])], module="bench.weights.clients")
    try:
        models: dict[str, str] = builder.expect("result", 900)["models"]
    finally:
        builder.finish()
    return models


def measure(ckpt: Checkpoint, model: Path, quick: bool, vllm_http_port: int) -> dict[str, Any]:
    """Serve `model` with its own `enginectl serve` and measure every figure on it (the pause
    row's baseline on the vLLM API server at `vllm_http_port`)."""
    from bench.lib.procs import Worker, bench_env, model_server

    server = model_server(
        model,
        [
            "--allow-weights-from",
            str(model),
            "--worker-extension-cls",
            "bench.lib.worker_ext.BenchWorkerExtension",
            "--weight-transfer-config",
            '{"backend": "gloo"}',
        ],
    )
    server.name = f"enginectl-weights-{ckpt.key}"
    server.keep_lines = True  # the "weights updated" events: where each update's time went
    server.env = bench_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # bench.lib.worker_ext importable by the worker
    server.start()
    try:
        server.wait_ready()
        worker = Worker(
            [
                "run",
                "--target",
                server.grpc_target,
                "--http-port",
                str(server.http_port),
                "--vllm-http-port",
                str(vllm_http_port),
                "--model",
                str(model),
                "--reps",
                "2" if quick else "7",
                "--pause-reps",
                "5" if quick else "30",
            ],
            module="bench.weights.clients",
        )
        try:
            result = worker.expect("result", 1800)
        finally:
            worker.finish()
        result["staging"] = staging.measure(server, model, quick)
    finally:
        stop = server.stop()
        if stop.get("children_left"):
            raise RuntimeError(f"the weights server left children: {stop}")
    result.pop("event", None)
    result.update(model=str(model), label=ckpt.label, hidden=ckpt.hidden, layers=ckpt.layers, server_stop=stop)
    result["phases_ms"] = phase_medians(server.events())
    return result


def phase_medians(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per update kind (the bench's version prefix: disk, gloo, gloo-1x, tensors, ipc, commit), the
    median of each phase of the server's "weights updated" events (server/weights/updates.py)."""
    by_kind: dict[str, dict[str, list[float]]] = {}
    for event in events:
        if event.get("event") != "weights updated" or not isinstance(event.get("phases_ms"), dict):
            continue
        kind = str(event.get("version") or "").rsplit("-", 1)[0]
        for name, ms in event["phases_ms"].items():
            by_kind.setdefault(kind, {}).setdefault(name, []).append(float(ms))
    return {
        kind: {name: round(statistics.median(values), 1) for name, values in phases.items()}
        for kind, phases in by_kind.items()
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("weights")
    if not res:
        return []
    out = []
    for key, ck in res["checkpoints"].items():
        out += _checkpoint_figures(key, ck)
    return out


def _checkpoint_figures(key: str, ck: dict[str, Any]) -> list[dict[str, Any]]:
    """The pause row, the update rows and the two-phase rows (bench/staging/phase.py) of one checkpoint."""
    what = f"{ck['label']} ({ck['num_tensors']} tensors, {ck['payload_bytes'] / 1e6:.0f} MB)"
    pause, trip = ck["pause"], ck["engine_round_trip_floor"]
    ours_ms, http_ms = pause["enginectl"]["median_ms"], pause["vllm_http"]["median_ms"]
    out = [
        {
            "figure": f"PauseGeneration + ResumeGeneration round trip, {ck['label']}",
            "checkpoint": key,
            "baseline": "vLLM HTTP /pause + /resume (plain vLLM API server, idle)",
            "baseline_value": http_ms,
            "enginectl_value": ours_ms,
            "unit": "ms",
            "ratio": _ratio(ours_ms, http_ms),
            "target": f"<= {PAUSE_TARGET_FLOORS}x floor ({PAUSE_TARGET_FLOORS * trip['floor_ms']:.3f} ms)",
            "met": ours_ms <= PAUSE_TARGET_FLOORS * trip["floor_ms"],
            "floor_value": trip["floor_ms"],
            "floor": f"{trip['floor_ms']:.3f} ms (2 x GetGenerationState p50)",
        }
    ]
    disk, gloo, tensors, copy = ck["disk"], ck["gloo"], ck["tensors"], ck["memcpy_floor"]
    reload_gbs = disk["reload_weights"]["gb_per_s"]
    rows = [
        ("disk", "UpdateWeightsFromDisk", "in-process reload_weights", reload_gbs, disk),
        (
            "gloo",
            "UpdateWeightsFromDistributed (gloo)",
            "min(raw gloo broadcast, reload_weights)",
            min(gloo["raw_gloo"]["gb_per_s"], reload_gbs),
            gloo,
        ),
        (
            "tensors",
            "UpdateWeightsFromTensors",
            "raw gRPC client stream",
            tensors["raw_grpc_stream"]["gb_per_s"],
            tensors,
        ),
    ]
    if "nccl" in ck:  # only where CUDA is (bench/weights/clients.py measure_nccl)
        rows.append(
            ("nccl", "UpdateWeightsFromDistributed (NCCL)", "in-process reload_weights", reload_gbs, ck["nccl"])
        )
    if "ipc" in ck:
        rows.append(
            (
                "ipc",
                "UpdateWeightsFromIpc (same host, zero copy)",
                "reload_weights of the same tensors in memory",
                ck["ipc"]["reload_in_memory"]["gb_per_s"],
                ck["ipc"],
            )
        )
    fingerprint_ms = disk.get("fingerprint", {}).get("median_ms")
    for kind, rpc, baseline, base, group in rows:
        ours = group["enginectl"]["gb_per_s"]
        ratio = _ratio(ours, base)
        floor = f"memcpy {copy['gb_per_s']:.3f} GB/s = {copy['median_ms']:.0f} ms"
        if fingerprint_ms is not None:  # what the contract adds to the baseline (bench/weights/floors.py)
            with_fingerprint = ck["payload_bytes"] / base / 1e6 + fingerprint_ms
            floor += (
                f"; baseline + the declaration's fingerprint ({fingerprint_ms:.0f} ms) "
                f"{with_fingerprint:.0f} ms: {_ratio(with_fingerprint, group['enginectl']['median_ms'])}x of it"
            )
        both = group.get(BESIDE.get(kind, ""))
        if both:  # the raw transport with the in-memory reload beside it (bench/weights/floors.py)
            floor += (
                f"; transport and reload at once {both['median_ms']:.0f} ms: "
                f"{_ratio(both['median_ms'], group['enginectl']['median_ms'])}x of it"
            )
            if fingerprint_ms is not None:
                at_once = both["median_ms"] + fingerprint_ms
                floor += f", with the fingerprint {at_once:.0f} ms: {_ratio(at_once, group['enginectl']['median_ms'])}x"
        out.append(
            {
                "figure": f"{rpc}, {what}",
                "checkpoint": key,
                "baseline": baseline,
                "baseline_value": base,
                "enginectl_value": ours,
                "unit": "GB/s",
                "ratio": ratio,
                "target": f">= {TARGETS[kind]}",
                "met": ratio >= TARGETS[kind],
                "floor_value": copy["gb_per_s"],
                "floor": floor,
            }
        )
    for figure, baseline, ours_ms, base_ms in transfer_rows(ck):
        native = baseline.startswith("vLLM's native")
        out.append(
            {
                "figure": f"{figure}, {what}",
                "checkpoint": key,
                "baseline": baseline,
                "baseline_value": base_ms,
                "enginectl_value": ours_ms,
                "unit": "ms",
                "ratio": _ratio(ours_ms, base_ms),
                "target": "<= 1.05" if native else "reported",
                "met": _ratio(ours_ms, base_ms) <= 1.05 if native else True,
                "floor_value": base_ms,
                "floor": "the same engine, group and checkpoint, rounds interleaved (bench/weights/transfer.py)",
            }
        )
    if "staging" in ck:
        out += staging.figures(what, key, ck["staging"], copy)
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("weights")
    if not res:
        return []
    lines: list[str] = []
    for ck in res["checkpoints"].values():
        lines += _checkpoint_table(ck)
    lines += [
        "",
        "server ms: the Operation's own duration (acceptance to done: pause, receive/load, cache "
        "reset, fingerprints, resume); rank 0 receive+load ms: RankUpdateResult.duration. "
        "/ floor: median ms over the row's floor ms.",
        "",
        "Floors, measured in the same run by the bench's client process on the same machine "
        "(bench/weights/floors.py): *memcpy*: every load writes the whole payload into the parameters at "
        "least once, so no load beats `Tensor.copy_` of the checkpoint's own tensors into "
        "buffers allocated once (a first pass faults them in; one pass is timed after every update "
        "rep, with 1 thread and with torch's default, and the faster median is the floor: on a busy "
        "2-core machine a parallel copy stalls on a descheduled thread; floor ms = payload / that "
        "bandwidth); the flat row copies the same bytes as one buffer. "
        "*Engine round trip*: pause and resume each need one EngineCore utility round trip "
        "behind one gRPC call; GetGenerationState is one gRPC call making exactly one EngineCore "
        "round trip per rank (server/weights/update/generation.py, server/engine.py), sampled twice "
        "between pause reps: the pause + resume floor is 2 x its p50.",
    ]
    return lines


def _checkpoint_table(ck: dict[str, Any]) -> list[str]:
    copy, trip = ck["memcpy_floor"], ck["engine_round_trip_floor"]
    lines = [
        "",
        (
            f"Weight updates, {ck['label']} ({ck['num_tensors']} tensors, {ck['payload_bytes'] / 1e6:.0f} MB "
            f"float32, synthetic Llama hidden {ck['hidden']}, {ck['layers']} layers, files in page cache; "
            "medians of interleaved reps):"
        ),
        "",
        "| measure | n | median ms | min ms | GB/s | server ms | rank 0 receive+load ms | floor ms | / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group in ("pause", "disk", "gloo", "nccl", "tensors", "ipc"):
        if group not in ck:
            continue
        floor_ms = trip["floor_ms"] if group == "pause" else copy["median_ms"]
        for name, s in ck[group].items():
            lines.append(
                f"| {group}: {name} | {s['n']} | {s['median_ms']} | {s['min_ms']} | "
                f"{s.get('gb_per_s', '')} | {s.get('server_ms', '')} | {s.get('rank_ms', '')} | "
                f"{floor_ms} | {_ratio(s['median_ms'], floor_ms)} |"
            )
    lines += [
        f"| floor: memcpy, per-tensor copy_ (faster: {copy['torch_threads']} thread(s)) | {copy['passes']} | "
        f"{copy['median_ms']} | {copy['min_ms']} | {copy['gb_per_s']} |  |  |  |  |",
        f"| floor: memcpy, one flat buffer | {copy['passes']} | {copy['flat_median_ms']} |  | "
        f"{copy['flat_gb_per_s']} |  |  |  |  |",
        f"| floor: GetGenerationState (one engine round trip) | {trip['n']} | {trip['p50_ms']} | "
        f"{trip['min_ms']} |  |  |  |  |  |",
    ]
    phases = ck.get("phases_ms") or {}
    if phases:
        lines += [
            "",
            "Where an update's time goes (the server's own phase timings, `phases_ms` of its "
            '"weights updated" log line; medians, ms): *pause* pauses generation, *load* receives '
            "and loads on every rank, *finish* is one round trip per rank (prefix-cache reset, "
            "version stamp, resume: generation is paused until it ends), *fingerprint* the "
            "declaration's sampled fingerprint, taken after generation resumed. A *commit* of staged weights loads "
            "from the worker's staging buffer (bench/staging/phase.py).",
            "",
            "| update | pause | load | finish | fingerprint |",
            "|---|---|---|---|---|",
        ]
        for kind, p in sorted(phases.items()):
            lines.append(
                f"| {kind} | {p.get('pause', '')} | {p.get('load', '')} | {p.get('finish', '')} | "
                f"{p.get('fingerprint', '')} |"
            )
    if "staging" in ck:
        lines += staging.markdown(ck["staging"])
    return lines
