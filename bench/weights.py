"""Weight updates and pause/resume (bench/README.md, figure 6), each against its baseline in one run.

Runs in the `python -m bench` process, which only orchestrates: a worker subprocess builds
(once, under bench/.cache, never committed) a synthetic float32 Llama with hidden size 1024
(4 layers, ~200 MB; `--quick`: 1 layer, ~60 MB), an `enginectl serve` subprocess serves it
(VLLM_SERVER_DEV_MODE=1 for vLLM's /pause, /resume and /collective_rpc routes), and
`python -m bench.weights_clients run` measures every figure and its baseline interleaved,
rep by rep, on the same server and the same bytes (see that module for what each pair is).
"""

from __future__ import annotations

from typing import Any

PAUSE_TARGET_MS = 5.0
TARGETS = {"disk": 0.9, "gloo": 0.9, "tensors": 0.8}


def phase(quick: bool) -> dict[str, Any]:
    from bench.procs import Worker, enginectl_server

    builder = Worker(["build", "--layers", "1" if quick else "4"], module="bench.weights_clients")
    try:
        model = builder.expect("result", 600)["model"]
    finally:
        builder.finish()
    server = enginectl_server(
        [
            "--model",
            model,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--max-num-seqs",
            "8",
            "--seed",
            "0",
            "--allow-weights-from",
            model,
        ]
    )
    server.name = "enginectl-weights"
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
                "--model",
                model,
                "--reps",
                "2" if quick else "7",
                "--pause-reps",
                "5" if quick else "30",
            ],
            module="bench.weights_clients",
        )
        try:
            result = worker.expect("result", 1800)
        finally:
            worker.finish()
        result.pop("event", None)
        result["model"] = model
        return result
    finally:
        result_stop = server.stop()
        if result_stop.get("children_left"):
            raise RuntimeError(f"the weights server left children: {result_stop}")


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("weights")
    if not res:
        return []
    mb = res["payload_bytes"] / 1e6
    pause = res["pause"]
    ours_ms, http_ms = pause["enginectl"]["median_ms"], pause["vllm_http"]["median_ms"]
    out = [
        {
            "figure": "PauseGeneration + ResumeGeneration round trip",
            "baseline": "vLLM HTTP /pause + /resume",
            "baseline_value": http_ms,
            "enginectl_value": ours_ms,
            "unit": "ms",
            "ratio": _ratio(ours_ms, http_ms),
            "target": f"<= {PAUSE_TARGET_MS} ms",
            "met": ours_ms <= PAUSE_TARGET_MS,
        }
    ]
    disk, gloo, tensors = res["disk"], res["gloo"], res["tensors"]
    reload_gbs = disk["reload_weights"]["gb_per_s"]
    rows = [
        (
            "disk",
            f"UpdateWeightsFromDisk, {mb:.0f} MB",
            "in-process reload_weights",
            reload_gbs,
            disk["enginectl"]["gb_per_s"],
        ),
        (
            "gloo",
            f"UpdateWeightsFromDistributed (gloo), {mb:.0f} MB",
            "min(raw gloo broadcast, reload_weights)",
            min(gloo["raw_gloo"]["gb_per_s"], reload_gbs),
            gloo["enginectl"]["gb_per_s"],
        ),
        (
            "tensors",
            f"UpdateWeightsFromTensors, {mb:.0f} MB",
            "raw gRPC client stream",
            tensors["raw_grpc_stream"]["gb_per_s"],
            tensors["enginectl"]["gb_per_s"],
        ),
    ]
    for key, figure, baseline, base, ours in rows:
        ratio = _ratio(ours, base)
        out.append(
            {
                "figure": figure,
                "baseline": baseline,
                "baseline_value": base,
                "enginectl_value": ours,
                "unit": "GB/s",
                "ratio": ratio,
                "target": f">= {TARGETS[key]}",
                "met": ratio >= TARGETS[key],
            }
        )
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("weights")
    if not res:
        return []
    lines = [
        "",
        (
            f"Weight updates ({res['num_tensors']} tensors, {res['payload_bytes'] / 1e6:.0f} MB float32, "
            "synthetic Llama hidden 1024, files in page cache; medians of interleaved reps):"
        ),
        "",
        "| measure | n | median ms | min ms | GB/s | server ms | rank 0 receive+load ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in ("pause", "disk", "gloo", "tensors"):
        for name, s in res[group].items():
            lines.append(
                f"| {group}: {name} | {s['n']} | {s['median_ms']} | {s['min_ms']} | "
                f"{s.get('gb_per_s', '')} | {s.get('server_ms', '')} | {s.get('rank_ms', '')} |"
            )
    lines.append("")
    lines.append(
        "server ms: the Operation's own duration (acceptance to done: pause, receive/load, cache "
        "reset, fingerprints, resume); rank 0 receive+load ms: RankUpdateResult.duration."
    )
    return lines
