"""`python -m bench.recovery` (`make recovery-soak`): is a recovery after a partial update one
you can trust? A bounded soak of one real `enginectl serve` (issue 36).

Not part of `make test` or CI. Runs in its own process; everything is on 127.0.0.1. One
`enginectl serve --enable-scale-out --allow-weights-from <tmp root> --weight-transfer-config
'{"backend": "gloo"}'` on the embedded tiny model (started and stopped by bench/lib/procs.py),
and a trainer subprocess (bench/recovery/trainer.py: it builds checkpoints A, a copy of the
served model, B, A perturbed, and a poisoned copy of each; it sends what needs torch, which
stays out of this process).

References first, on the fresh server: the greedy tokens of the checked prompts
(bench/recovery/generation.py) on A as served, then after a clean disk load of A and of B
each, with the full VerifyWeights digest of every rank and worker after each load.

Then rounds, until `--rounds` or `--duration` (whichever first; a round started is finished),
with rollout threads looping short completions throughout (held only while a check reads its
tokens; one whose output is all token 0 while the server is trusted, from a recovery's success
to the next round, is sent again, and a different answer counts as poisoned). Each round:

1. a partial update of the checkpoint not served now (with probability `--nan-partials`, 0.3,
   of its poisoned copy: NaN in every tensor, as a diverged trainer sends; a partial update
   of those leaves weights that compute NaN, whatever memory the unloaded parts hold),
   through the next source in turn (bench/recovery/breaks.py says how each one breaks):
   - `stream`: a raw tensor stream of every tensor's header and the bytes of the first k
     (random) tensors; once the server wrote them, the client cancels the call or half-closes it;
   - `disk`: UpdateWeightsFromDisk cancelled at once or once it wrote a tensor;
   - `broadcast`: a trainer subprocess broadcasts k tensors through a fresh gloo group and is
     killed (SIGKILL) once the server wrote them;
   - `ipc`: UpdateWeightsFromIpc cancelled at once or once it wrote a tensor (the trainer);
   - `transfer`: a round of vLLM's weight-transfer API through enginectl's `gloo` engine that
     sends one batch of k tensors and goes away (TRANSFER_STEP_TIMEOUT; the engine applies
     at the finish only, so this one never writes).
   Each ends PARTIAL_UPDATE (weights written: the server must be quarantined: undeclared with
   `last_failure`, paused, NOT_SERVING), refused (nothing written: nothing may change) or
   completed (the break came too late: the update succeeded). All three are counted, and
   the server's state after each is checked against what it claims;
2. after a partial update, with probability 1/2: 2-4 completions (20-200 prompt ids, 16-48
   tokens) queued while paused, then ResumeGeneration(force=true), so that they generate over
   the mixed weights and write their KV-cache blocks (the server must stay NOT_SERVING
   meanwhile; completions that come back all token 0 computed NaN: `nan_generations`);
3. a full update of A or B (random) through a random source (disk, tensor stream, gloo
   broadcast, IPC, transfer round) with a version; then the check (bench/recovery/checks.py):
   declared with that version, no last_failure, not paused, health SERVING, every prompt's
   greedy tokens equal to that checkpoint's references, VerifyWeights(full) MATCH with the
   reference digest on every rank and worker. Any difference is a mismatch.

Every wait has a deadline. Writes bench/results/recovery/latest.json and latest.md; exits 1
on any mismatch, a poisoned rollout, a server state that contradicts an outcome, an
unexpected error, or the engine dying.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench.lib.harness import ServeProcess
from bench.lib.procs import HTTP_STARTUP_LINE, Worker, enginectl_server, wait_http_ready
from bench.lib.progress import log
from bench.lib.provenance import machine_info, repo_info
from bench.recovery.checks import digests, reference
from bench.recovery.generation import RolloutGate, RolloutStats, TrustWindow, greedy, prompts, rollout_loop
from bench.recovery.report import markdown
from bench.recovery.rounds import (
    FORCED_RESUME_P,
    PARTIAL_SOURCES,
    RECOVERY_SOURCES,
    TRAINER_READY_S,
    UPDATE_TIMEOUT_S,
    Rounds,
    Serving,
    Unexpected,
)
from enginectl.client import EnginectlError, TrainerClient

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results" / "recovery"
WORKER_ID = "recovery"
ROLLOUT_JOIN_S = 150.0  # a rollout's own bound (its request timeout) and some


def take_references(s: Serving) -> dict[str, Any]:
    """Greedy tokens and full digests of A and B on the fresh server (fills `s.refs`)."""
    initial = s.client.verify_weights(full=True)
    served = greedy(s.http_port, s.model, s.prompts)
    for which in ("A", "B"):
        s.client.update_weights_from_disk(s.checkpoints[which], f"reference-{which}", timeout=UPDATE_TIMEOUT_S)
        verification = s.client.verify_weights(full=True)
        if verification.verdict != "MATCH":
            raise Unexpected(f"VerifyWeights(full) after a clean load of {which}: {verification.verdict}")
        s.refs[which] = reference(greedy(s.http_port, s.model, s.prompts), verification)
    a, b = s.refs["A"], s.refs["B"]
    if a.tokens != served:
        raise Unexpected(f"A's tokens after a clean disk load {a.tokens} are not those of A as served {served}")
    if a.tokens == b.tokens or a.ranks == b.ranks:
        raise Unexpected("A and B can not be told apart (equal tokens or digests)")
    return {
        "prompt_lengths": [len(p) for p in s.prompts],
        "method": a.method,
        "served_weights_digest_is_As": digests(initial)[0] == a.ranks,
        **{w: {"tokens": r.tokens, "rank_digests": r.ranks, "worker_digests": r.workers} for w, r in s.refs.items()},
    }


def why_stop(server: ServeProcess, trainer: Worker, dead_line: threading.Event) -> str | None:
    """Why the rounds can not go on (None: they can)."""
    if server.proc is None or server.proc.poll() is not None:
        return "enginectl serve exited"
    if dead_line.is_set():
        return "the server logged EngineDeadError"
    if trainer.proc.poll() is not None:
        return f"the trainer exited with {trainer.proc.returncode}"
    return None


def run(args: argparse.Namespace, partial: tuple[str, ...], recovery: tuple[str, ...]) -> dict[str, Any]:
    t_begin = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="enginectl-recovery-"))
    server = enginectl_server(
        ["--enable-scale-out", "--worker-id", WORKER_ID, "--allow-weights-from", str(root)]
        + ["--weight-transfer-config", '{"backend": "gloo"}']
    )
    server.name = "enginectl-recovery"
    startup_line = server.watch(HTTP_STARTUP_LINE)
    dead_line = server.watch(b"EngineDeadError")
    results: dict[str, Any] = {
        "machine": machine_info(),
        "repo": repo_info(),
        "config": {
            "rounds": args.rounds,
            "duration_s": args.duration,
            "seed": args.seed,
            "rollout_threads": args.rollouts,
            "partial_sources": list(partial),
            "recovery_sources": list(recovery),
            "nan_partials": args.nan_partials,
            "forced_resume_p": FORCED_RESUME_P,
            "update_timeout_s": UPDATE_TIMEOUT_S,
        },
    }
    stop, gate, window, rollouts = threading.Event(), RolloutGate(), TrustWindow(), RolloutStats()
    threads: list[threading.Thread] = []
    trainer: Worker | None = None
    rounds: Rounds | None = None
    try:
        log("starting enginectl serve")
        server.start()
        server.wait_ready()
        results["http_ready"] = wait_http_ready(server, startup_line)
        results["server"] = {k: server.serving.get(k) for k in ("model", "dp_size", "grpc_port", "http_port")}
        model_dir = Path(server.model)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        log(f"serving on {server.grpc_target}; building checkpoints A and B under {root}")
        trainer = Worker(
            ["serve", "--target", server.grpc_target, "--model", str(model_dir), "--root", str(root)]
            + ["--timeout", str(UPDATE_TIMEOUT_S)],
            module="bench.recovery.trainer",
        )
        ready = trainer.expect("ready", TRAINER_READY_S)
        results["checkpoints"] = {"tensors": ready["tensors"], "bytes": ready["bytes"]}
        with (
            grpc.insecure_channel(server.grpc_target) as channel,
            TrainerClient(server.grpc_target, timeout=UPDATE_TIMEOUT_S) as client,
        ):
            serving = Serving(
                server, trainer, client, channel, ready["checkpoints"], int(ready["tensors"]), vocab, prompts(vocab)
            )
            log("taking the references on the fresh server")
            results["references"] = take_references(serving)
            # The references end on B: the first partial update is one of A.
            rng = random.Random(args.seed)
            rounds = Rounds(serving, rng, gate, window, stop, partial, recovery, args.nan_partials, current="B")
            deadline = rounds.t0 + args.duration
            threads = [
                threading.Thread(
                    target=rollout_loop,
                    args=(server.http_port, server.served_model, vocab, 100 + i, gate, window, stop, deadline)
                    + (int(args.duration * 50) + 100, rollouts),
                    name=f"rollout-{i}",
                    daemon=True,
                )
                for i in range(args.rollouts)
            ]
            for t in threads:
                t.start()
            log(f"rounds: up to {args.rounds} within {args.duration:.0f}s")
            for n in range(args.rounds):
                if time.monotonic() >= deadline:
                    break
                if (why := why_stop(server, trainer, dead_line)) is not None:
                    rounds.tally.errors.append({"round": n, "error": why})
                    break
                try:
                    rounds.run(n)
                except (EnginectlError, RuntimeError, OSError) as exc:  # Unexpected, a worker's error line, ...
                    log(f"round {n}: unexpected {type(exc).__name__}: {exc}")
                    rounds.tally.errors.append({"round": n, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            results["rounds_s"] = round(time.monotonic() - rounds.t0, 1)
            stop.set()
            gate.close()
            try:  # rollouts queued behind a quarantine that a failed recovery left
                client.resume_generation(force=True)
            except EnginectlError as err:
                rounds.tally.errors.append({"round": None, "error": f"the last resume: {err}"})
            for t in threads:
                t.join(ROLLOUT_JOIN_S)
            results["stuck_threads"] = [t.name for t in threads if t.is_alive()]
    except Exception as exc:  # noqa: BLE001 - the run failed before its end: say why in the results
        log(f"recovery soak aborted: {exc!r}")
        results["crash"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        stop.set()
        gate.close()
        if trainer is not None:
            results["trainer_exit"] = trainer.finish()
        results["server_stop"] = server.stop()
        shutil.rmtree(root, ignore_errors=True)
    results["rollouts"] = {
        "threads": args.rollouts,
        "requests": rollouts.requests,
        "completed": rollouts.completed,
        "output_tokens": rollouts.output_tokens,
        "all_zero_outputs": rollouts.all_zero,
        "all_zero_while_trusted": rollouts.all_zero_trusted,
        "poisoned_count": len(rollouts.poisoned),
        "poisoned": rollouts.poisoned[:20],
        "errors": dict(rollouts.errors),
    }
    results["rounds_run"] = len(rounds.records) if rounds else 0
    if rounds is not None:
        results |= rounds.tally.summary()
    results["rounds"] = rounds.records if rounds else []
    results["elapsed_s"] = round(time.monotonic() - t_begin, 1)
    results["failures"] = failures(results)
    results["passed"] = not results["failures"]
    return results


def failures(r: dict[str, Any]) -> list[str]:
    """Why the run failed, one line each (none: it passed)."""
    server_errors = sum(n for k, n in r["rollouts"]["errors"].items() if k.startswith("HTTP_5"))
    out = [f"{k}: {len(r[k])}" for k in ("mismatches", "anomalies", "errors") if r.get(k)]
    if r["rollouts"]["poisoned_count"]:
        out.append(f"rollouts poisoned while trusted: {r['rollouts']['poisoned_count']}")
    if server_errors:
        out.append(f"rollouts answered HTTP 5xx {server_errors} times")
    if "crash" in r:
        out.append(f"crashed: {r['crash']}")
    if r.get("stuck_threads"):
        out.append(f"threads stuck: {r['stuck_threads']}")
    if not r["rounds_run"] and "crash" not in r:
        out.append("no round ran")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.recovery", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds at most (default 40)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of rounds at most (default 600)")
    parser.add_argument("--rollouts", type=int, default=2, choices=(0, 1, 2), help="rollout threads (default 2)")
    parser.add_argument("--seed", type=int, default=36, help="seed of every random choice (default 36)")
    parser.add_argument(
        "--partial-sources", default=",".join(PARTIAL_SOURCES), help="how partial updates are caused, in turn"
    )
    parser.add_argument(
        "--recovery-sources", default=",".join(RECOVERY_SOURCES), help="what a recovery update picks from"
    )
    parser.add_argument(
        "--nan-partials",
        type=float,
        default=0.3,
        help="fraction of partial updates that send a poisoned copy of the checkpoint (NaN weights; default 0.3)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    partial = tuple(s for s in args.partial_sources.split(",") if s)
    recovery = tuple(s for s in args.recovery_sources.split(",") if s)
    if args.rounds < 1 or args.duration <= 0:
        parser.error("--rounds and --duration must be positive")
    if not 0 <= args.nan_partials <= 1:
        parser.error("--nan-partials: a fraction in [0, 1]")
    if not partial or set(partial) - set(PARTIAL_SOURCES):
        parser.error(f"--partial-sources: a comma-separated subset of {','.join(PARTIAL_SOURCES)}")
    if not recovery or set(recovery) - set(RECOVERY_SOURCES):
        parser.error(f"--recovery-sources: a comma-separated subset of {','.join(RECOVERY_SOURCES)}")
    results = run(args, partial, recovery)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    md = markdown(results)
    (args.out / "latest.md").write_text(md)
    print(md)
    log(
        f"done in {results['elapsed_s']}s; wrote {args.out / 'latest.json'} and latest.md; "
        + ("PASSED" if results["passed"] else "FAILED: " + "; ".join(results["failures"]))
    )
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
