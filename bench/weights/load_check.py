"""The cost of the check after every load (phase `load_check`; bench/README.md): the same
updates on a server with `--load-check full` (the default: every layer computes with the bytes
the load wrote into it, worker/weights/written.py) beside one with `--load-check finite` (the
finiteness check alone), in one run.

Runs in the `python -m bench` process, which only orchestrates: it builds the weights phase's
synthetic checkpoints with the weights phase's own builder (bench/lib/checkpoints.py), and per
checkpoint starts both servers at once on it (the weights phase's flags: float32, eager, 64 MiB
of KV cache); the trainer is tensor_parallel.py's (`python -m bench.weights.tensor_parallel
run`): a warm-up update of each kind on each server, not kept, then rep by rep
UpdateWeightsFromDisk and UpdateWeightsFromTensors of the same checkpoint on each server, the
servers' order alternating (ABBA), each followed, untimed, by a full VerifyWeights that waits
out the declaration's background fingerprint.

Figures (reported): median update time full / finite, per kind and checkpoint; and the two
servers' own `check` phase (the CHECK_LOADED round trip) of their "weights updated" lines. The
recording happens inside the load (as vLLM processes each layer), so the ratio of the whole
update is the figure; the check phase shows the part after the load.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.lib.checkpoints import Checkpoint, checkpoints
from bench.lib.progress import log
from bench.lib.stats import median_ms, ratio
from bench.weights.phase import built_models, phase_medians
from bench.weights.tensor_parallel import KINDS, RPCS, WARMUP, described, side_by_side

SERVERS = ("full", "finite")


def phase(quick: bool) -> dict[str, Any]:
    models = built_models("load_check", quick)
    out: dict[str, Any] = {"checkpoints": {}}
    for ckpt in checkpoints(quick):
        log(f"load_check: {ckpt.label} checkpoint, a --load-check full and a --load-check finite server")
        out["checkpoints"][ckpt.key] = measure(ckpt, Path(models[ckpt.key]), 2 if quick else 15)
    return out


def measure(ckpt: Checkpoint, model: Path, reps: int) -> dict[str, Any]:
    """Serve `model` twice at once, one server per check, and run the trainer against both."""
    from bench.lib.procs import model_server

    servers = {}
    for name in SERVERS:
        servers[name] = model_server(model, ["--allow-weights-from", str(model), "--load-check", name])
        servers[name].name = f"enginectl-check-{name}-{model.name}"
        servers[name].keep_lines = True  # the "weights updated" events: the check phase
    result, stops = side_by_side("load_check", servers, model, reps)
    runs = result["runs"]
    out: dict[str, Any] = {k: result[k] for k in ("num_tensors", "payload_bytes", "reps")}
    for name in SERVERS:
        out[name] = {
            kind: {
                "wall": median_ms([r["seconds"] for r in runs[name][kind]]),
                "server_ms": round(statistics.median(r["server_s"] for r in runs[name][kind]) * 1e3, 1),
            }
            for kind in KINDS
        }
    out["phases_ms"] = {
        name: {k: v for k, v in phase_medians(s.events()).items() if not k.startswith(WARMUP)}
        for name, s in servers.items()
    }
    out.update(label=ckpt.label, hidden=ckpt.hidden, layers=ckpt.layers, model=str(model), server_stops=stops)
    return out


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("load_check")
    if not res:
        return []
    out = []
    for key, ck in res["checkpoints"].items():
        for kind in KINDS:
            full, finite = ck["full"][kind]["wall"], ck["finite"][kind]["wall"]
            checks = {name: ck["phases_ms"].get(name, {}).get(kind, {}).get("check", "") for name in SERVERS}
            out.append(
                {
                    "figure": f"{RPCS[kind]} with the check after every load (--load-check full), {described(ck)}",
                    "checkpoint": key,
                    "baseline": "the same update with --load-check finite, same run, reps interleaved",
                    "baseline_value": finite["median_ms"],
                    "enginectl_value": full["median_ms"],
                    "unit": "ms",
                    "ratio": ratio(full["median_ms"], finite["median_ms"]),
                    "target": "reported (no target)",
                    "met": None,
                    "floor": f"check phase full / finite: {checks['full']} / {checks['finite']} ms",
                }
            )
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    res = results.get("load_check")
    if not res:
        return []
    lines: list[str] = []
    for ck in res["checkpoints"].values():
        lines += [
            "",
            (
                f"The check after every load, {described(ck)} float32, synthetic Llama hidden {ck['hidden']}, "
                f"{ck['layers']} layers; a `--load-check full` and a `--load-check finite` server at once; "
                f"{ck['reps']} interleaved reps (ABBA); median ms (min-max); check: the CHECK_LOADED phase."
            ),
            "",
            "| update | finite | full | full / finite | check finite / full |",
            "|---|---|---|---|---|",
        ]
        for kind in KINDS:
            a, b = ck["finite"][kind]["wall"], ck["full"][kind]["wall"]
            checks = [ck["phases_ms"].get(name, {}).get(kind, {}).get("check", "") for name in ("finite", "full")]
            lines.append(
                f"| {RPCS[kind]} | {a['median_ms']} ({a['min_ms']}-{a['max_ms']}) | "
                f"{b['median_ms']} ({b['min_ms']}-{b['max_ms']}) | {ratio(b['median_ms'], a['median_ms'])} | "
                f"{checks[0]} / {checks[1]} |"
            )
    return lines
