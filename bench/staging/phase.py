"""Two-phase (staged) weight updates (bench/README.md, figure 6, "Two-phase updates"), on
the weights bench's server, one checkpoint at a time.

Runs in the `python -m bench` process, which only orchestrates; bench/weights/phase.py calls
`measure` with the server it started for a checkpoint, once its other figures are done:

- **Generation pause of a commit.** `python -m bench.staging.clients commit` stages the
  checkpoint from disk, then commits it while a long rollout streams, interleaved rep by rep
  with vLLM's reload_weights over the same tensors already in the worker's memory
  (bench/lib/worker_ext.py, through /collective_rpc) while a rollout streams. The commit's pause
  is the server's paused window, load + finish of the `phases_ms` of its "weights updated"
  log line: from the pause's answer (the engine answers once it paused, after the step in
  flight) to the resume's; the baseline is the reload's time inside the worker. The window
  from the commit's start (pause + load + finish, which includes that wait for the step in
  flight while generation still runs) is reported beside it. From the rollout's side: the
  longest gap between two streamed tokens across the commit vs across the reload.
  Each rep also times that reload over views of one flat buffer (the staging buffer's
  layout), which splits a commit's extra load time into layout and the rest, and a commit
  that keeps the prefix cache (`reset_prefix_cache=false`), whose token gap leaves out the
  rollout's recompute of its KV after the reset.
- **Rollout throughput while staging.** Rounds cycle idle, staging, control, idle, ...:
  each runs the bench's rollout driver (bench/lib/procs.py `rollout_driver`, streaming
  /v1/completions) for a window; in a staging round `python -m bench.staging.clients
  stage-loop` stages the checkpoint from disk and discards it back to back (a discard frees
  the staging buffer, so every stage fills fresh pages), from before the rollouts start
  until after the window ends. The control round runs `copy-loop` instead: the staging
  thread's work (read, copy into fresh pages, CRC32) in a process of its own, which shows
  how much of the slowdown any process doing that work causes on this machine. Figure:
  median tokens/s staging / idle (reported; it has no target).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.lib.harness import ServeProcess
from bench.lib.progress import log
from bench.lib.stats import median_ms

COMMIT_PAUSE_TARGET = 1.1  # commit pause / in-memory reload_weights <=
ROLLOUT_STREAMS, ROLLOUT_TOKENS = 4, 64
MODES = ("idle", "staging", "control")
LOOPS = {"staging": "stage-loop", "control": "copy-loop"}


def measure(server: ServeProcess, model: Path, quick: bool) -> dict[str, Any]:
    """Both figures on `server`, which serves `model` with the bench's worker extension."""
    return {
        "commit": measure_commit(server, model, 2 if quick else 7),
        "throughput": measure_throughput(server, model, *((2, 2.0) if quick else (3, 5.0))),
    }


def measure_commit(server: ServeProcess, model: Path, reps: int) -> dict[str, Any]:
    from bench.lib.procs import Worker

    log(f"weights: staged commit vs in-memory reload_weights, {reps} reps, each under a streaming rollout")
    worker = Worker(
        [
            "commit",
            "--target",
            server.grpc_target,
            "--http-port",
            str(server.http_port),
            "--served-model",
            server.served_model,
            "--model",
            str(model),
            "--reps",
            str(reps),
        ],
        module="bench.staging.clients",
    )
    try:
        res = worker.expect("result", 900)
    finally:
        worker.finish()
    windows = paused_windows(server.events())
    commits, reloads = res["reps"]["commit"], res["reps"]["reload"]
    for rep in commits:
        phases = windows.get(rep["version"])
        if phases is None:
            raise RuntimeError(f"no 'weights updated' line for the commit {rep['version']}")
        rep["phases_ms"] = phases
        rep["paused_s"] = sum(phases.get(k, 0.0) for k in ("load", "finish")) / 1e3
        rep["window_s"] = sum(phases.get(k, 0.0) for k in ("pause", "load", "finish")) / 1e3
    return {
        "reps": reps,
        "lead_tokens": res["lead_tokens"],
        "commit": {
            "paused_window": median_ms([r["paused_s"] for r in commits]),
            "from_start": median_ms([r["window_s"] for r in commits]),
            "load": median_ms([r["phases_ms"].get("load", 0.0) / 1e3 for r in commits]),
            "worker_load": median_ms([r["rank_load_s"] for r in commits]),
            "client_call": median_ms([r["call_s"] for r in commits]),
            "token_gap": median_ms([r["gap_s"] for r in commits]),
            "token_gap_keep_kv": median_ms([r["gap_s"] for r in res["reps"]["keep_kv"]]),
            "stage_idle": median_ms([r["stage_s"] for r in commits]),
        },
        "reload_in_memory": {
            "in_worker": median_ms([r["worker_s"] for r in reloads]),
            "in_worker_flat": median_ms([r["worker_s"] for r in res["reps"]["flat"]]),
            "client_call": median_ms([r["call_s"] for r in reloads]),
            "token_gap": median_ms([r["gap_s"] for r in reloads]),
        },
        "steady_token_gap": median_ms([r["steady_gap_s"] for r in commits + reloads]),
        "raw": res["reps"],
    }


def paused_windows(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """`phases_ms` of every commit's "weights updated" line (server/weights/updates.py), by version."""
    return {
        str(e["version"]): {k: float(v) for k, v in e["phases_ms"].items()}
        for e in events
        if e.get("event") == "weights updated"
        and str(e.get("version") or "").startswith("commit-")
        and isinstance(e.get("phases_ms"), dict)
    }


def measure_throughput(server: ServeProcess, model: Path, rounds: int, window: float) -> dict[str, Any]:
    out: dict[str, Any] = {mode: {"rounds": []} for mode in MODES}
    for rnd in range(rounds):
        for mode in MODES:
            log(
                f"weights: rollouts {mode}, round {rnd + 1}/{rounds}, "
                f"{ROLLOUT_STREAMS} streams x {ROLLOUT_TOKENS} tokens, {window}s"
            )
            out[mode]["rounds"].append(_throughput_round(server, model, mode, window))
    for mode in MODES:
        rec, done = out[mode], out[mode]["rounds"]
        rec["tokens_per_s"] = round(statistics.median(r["tokens_per_s"] or 0.0 for r in done), 1)
        rec["errors"] = sum(r["errors"] for r in done)
        rec["completions"] = sum(r["completions"] for r in done)
        if mode in LOOPS:
            passes = [s for r in done for s in r["loop"]["pass_s"]]
            rec["passes"] = len(passes)
            rec["pass_median_s"] = round(statistics.median(passes), 3)
            rec["loop_gb_per_s"] = round(statistics.median(r["loop"]["gb_per_s"] or 0.0 for r in done), 3)
    out["_config"] = {"streams": ROLLOUT_STREAMS, "max_tokens": ROLLOUT_TOKENS, "rounds": rounds, "window_s": window}
    return out


def _throughput_round(server: ServeProcess, model: Path, mode: str, window: float) -> dict[str, Any]:
    """One window of rollouts; for staging or control, inside that loop, which starts first."""
    from bench.lib.procs import Worker, rollout_driver

    stager = None
    try:
        if mode in LOOPS:
            stager = Worker(
                [LOOPS[mode], "--target", server.grpc_target, "--model", str(model)], "bench.staging.clients"
            )
            stager.expect("looping", 300)
        driver = rollout_driver(server, ROLLOUT_STREAMS, ROLLOUT_TOKENS, window + 150)
        try:
            driver.expect("started", 150)
            time.sleep(window)  # the measurement window (the load runs meanwhile)
            driver.send("stop")
            res = driver.expect("result", 90)
        finally:
            driver.finish()
        if stager is not None:
            stager.send("stop")
            res["loop"] = stager.expect("result", 300)
            res["loop"].pop("event", None)
    finally:
        if stager is not None:
            stager.finish()
    res.pop("event", None)
    return res


def figures(what: str, key: str, st: dict[str, Any], copy_floor: dict[str, Any]) -> list[dict[str, Any]]:
    """The commit-pause rows (server window, rollout's view) and the throughput row of one checkpoint."""
    c, r, tp = st["commit"]["commit"], st["commit"]["reload_in_memory"], st["throughput"]
    floor = f"memcpy {copy_floor['gb_per_s']:.3f} GB/s = {copy_floor['median_ms']:.0f} ms"
    rows = []
    for figure, baseline, ours, base in (
        (
            "Generation pause of a staged commit (server: from the pause's answer to the resume's)",
            "reload_weights of the same tensors in the worker's memory (timed in the worker)",
            c["paused_window"]["median_ms"],
            r["in_worker"]["median_ms"],
        ),
        (
            "Longest token gap of a streaming rollout across a staged commit",
            "same across /collective_rpc in-memory reload_weights",
            c["token_gap"]["median_ms"],
            r["token_gap"]["median_ms"],
        ),
    ):
        ratio = round(ours / base, 3) if base else 0.0
        rows.append(
            {
                "figure": f"{figure}, {what}",
                "checkpoint": key,
                "baseline": baseline,
                "baseline_value": base,
                "enginectl_value": ours,
                "unit": "ms",
                "ratio": ratio,
                "target": f"<= {COMMIT_PAUSE_TARGET}",
                "met": ratio <= COMMIT_PAUSE_TARGET,
                "floor_value": copy_floor["median_ms"],
                "floor": floor,
            }
        )
    idle, busy, control = (tp[mode]["tokens_per_s"] for mode in MODES)
    rows.append(
        {
            "figure": (
                f"Rollout tokens/s ({tp['_config']['streams']} streams x {tp['_config']['max_tokens']} tokens) "
                f"while disk stages + discards run back to back, {what}"
            ),
            "checkpoint": key,
            "baseline": "same rollouts, no staging",
            "baseline_value": idle,
            "enginectl_value": busy,
            "unit": "tokens/s",
            "ratio": round(busy / idle, 3) if idle else 0.0,
            "target": "reported (no target)",
            "met": None,
            "floor": f"the staging thread's work in a process of its own: {control / idle if idle else 0:.2f}x idle",
        }
    )
    return rows


def markdown(st: dict[str, Any]) -> list[str]:
    """The two-phase tables of one checkpoint."""
    cm, tp = st["commit"], st["throughput"]
    lines = [
        "",
        f"Two-phase updates ({cm['reps']} interleaved reps; each commit and each reload made while one "
        f"streaming rollout runs, after its first {cm['lead_tokens']} tokens; ms):",
        "",
        "| measure | n | median ms | min ms | max ms |",
        "|---|---|---|---|---|",
    ]
    rows = [
        (
            "commit: server's paused window, pause answered to resume answered (load + finish)",
            cm["commit"]["paused_window"],
        ),
        ("commit: from its start to the resume's answer (pause + load + finish)", cm["commit"]["from_start"]),
        ("commit: load phase alone", cm["commit"]["load"]),
        ("commit: worker's own load time (rank 0 LoadResult.duration)", cm["commit"]["worker_load"]),
        ("commit: CommitStagedWeights call, client wall", cm["commit"]["client_call"]),
        ("commit: longest token gap across it", cm["commit"]["token_gap"]),
        (
            "commit keeping the prefix cache (reset_prefix_cache=false): longest token gap",
            cm["commit"]["token_gap_keep_kv"],
        ),
        ("reload in memory: in the worker (baseline)", cm["reload_in_memory"]["in_worker"]),
        (
            "reload in memory, views of one flat buffer (the staging layout): in the worker",
            cm["reload_in_memory"]["in_worker_flat"],
        ),
        ("reload in memory: /collective_rpc call, client wall", cm["reload_in_memory"]["client_call"]),
        ("reload in memory: longest token gap across it", cm["reload_in_memory"]["token_gap"]),
        ("rollout: median token gap before either call", cm["steady_token_gap"]),
        ("stage from disk, nothing else running (not paused)", cm["commit"]["stage_idle"]),
    ]
    lines += [f"| {name} | {s['n']} | {s['median_ms']} | {s['min_ms']} | {s['max_ms']} |" for name, s in rows]
    lines += [
        "",
        "The paused window runs from the pause's answer to the resume's: the engine answers a pause once "
        "it paused, after the step in flight, and resumes before it answers the finishing round trip, so "
        "the window is the pause to within one engine round trip. The commit's *pause* phase before it "
        "(reading every rank's state and pausing, one round trip) waits for that step while generation "
        "still runs: the window from the commit's start includes it. The reload's in-worker time leaves "
        "out its wait for the step in flight; both token gaps include it. A commit resets the prefix "
        "cache, so the rollout also recomputes its KV after it; the commit that keeps the cache shows "
        "what that recompute adds to the gap.",
    ]
    c = tp["_config"]
    lines += [
        "",
        f"Rollouts while staging ({c['streams']} streams x {c['max_tokens']} tokens on /v1/completions; "
        f"{c['rounds']} rounds of {c['window_s']}s per mode, cycling idle, staging, control; tokens/s: median "
        "of rounds). *staging*: stage from disk + discard, back to back (each stage fills fresh pages: a "
        "discard frees the buffer); *control*: the same work as a staging thread (read, copy into fresh "
        "pages, CRC32) in a process of its own. Loop GB/s: bytes moved per second of the window.",
        "",
        "| mode | tokens/s | / idle | per round | completions | errors | loop passes | pass median s | loop GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    idle = tp["idle"]["tokens_per_s"]
    for mode in MODES:
        rec = tp[mode]
        per_round = ", ".join(str(round(r["tokens_per_s"] or 0)) for r in rec["rounds"])
        lines.append(
            f"| {mode} | {rec['tokens_per_s']:.0f} | {round(rec['tokens_per_s'] / idle, 3) if idle else ''} | "
            f"{per_round} | {rec['completions']} | {rec['errors']} | {rec.get('passes', '')} | "
            f"{rec.get('pass_median_s', '')} | {rec.get('loop_gb_per_s', '')} |"
        )
    return lines
