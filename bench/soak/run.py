"""`python -m bench.soak` (`make soak`): a bounded soak of one real `enginectl serve`.

Not part of `make test` or CI. Runs in its own process; everything is on 127.0.0.1. One
`enginectl serve --enable-scale-out --worker-id soak --allow-weights-from <tmp dir>` on the
embedded tiny model (started and stopped by bench/lib/procs.py) gets, for `--duration` seconds
(default 600), all at once:

- rollouts: 2-4 threads looping `POST /inference/v1/generate` on vLLM's HTTP API, prompts of
  3-150 random token ids, max_tokens 1-11, temperature 0, one keep-alive connection each;
- weight updates back to back, rotating disk / tensor stream / gloo broadcast and the two
  checkpoints A and B, each with a weight_version, each followed by a declaration
  (SetWeightVersion without etag), and a VerifyWeights after every full rotation. Disk
  updates go from this process; tensor-stream and gloo updates from a trainer subprocess
  (bench/soak/trainer.py, which also builds the checkpoints: torch stays out of here);
- 2 CAS writers looping GetWeightVersion -> SetWeightVersion(etag);
- one WeightVersion watcher subscribed before anything starts, which must see every
  acknowledged write exactly once with consecutive revisions (lost writes: 0);
- a Watch subscriber and two FPM subscribers (one deliberately slow) that read a while,
  leave and resume (since_revision; resume_after_sequence + resume_incarnation), counting
  every sequence jump that no `missed` count explains (unreported gaps: 0);
- RSS, open fds and threads of the server and each of its child processes (psutil), at
  start, after the warm-up (`--warmup` of the duration) and at the end, taken between two
  updates; every `SAMPLE_INTERVAL_S` for the time series.

It fails (exit 1, naming each failed check) on growth from after-warm-up to the end beyond
the bounds in bench/soak/checks.py, on lost writes, on unreported FPM or Watch gaps, on the
engine dying, on any UNKNOWN/INTERNAL status (or HTTP 5xx), and on any other unexpected error.
Writes bench/results/soak/latest.json and latest.md. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.lib.harness import ServeProcess
from bench.lib.procs import HTTP_STARTUP_LINE, Worker, enginectl_server, wait_http_ready
from bench.lib.progress import log
from bench.lib.provenance import machine_info, repo_info
from bench.soak.checks import checks, verify_writes
from bench.soak.load import CasStats, RolloutStats, Updater, cas_loop, guarded, rollout_loop
from bench.soak.records import (
    SOURCES,
    UPDATE_TIMEOUT_S,
    VLLM_PLACEHOLDER,
    WORKER_ID,
    Errors,
    Snapshot,
    Writes,
    snapshot,
)
from bench.soak.report import markdown, rollout_summary, update_summary
from bench.soak.streams import Streams
from enginectl.client import Client

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results" / "soak"
# Each FPM subscriber's queue on the soak's server (`--fpm-subscriber-queue`, default 4,096):
# small, so that the slow reader (bench/soak/streams.py) overflows it within a session and the
# `missed` accounting is exercised; the fast reader drains it as samples arrive.
FPM_SUBSCRIBER_QUEUE = 64
SAMPLE_INTERVAL_S = 10.0


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Soak:
    duration: float
    warmup: float
    rollouts: int
    sources: tuple[str, ...]
    errors: Errors = field(default_factory=Errors)
    writes: Writes = field(default_factory=Writes)
    deaths: list[str] = field(default_factory=list)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)

    def alive(self, server: ServeProcess, start: Snapshot, dead_line: threading.Event) -> bool:
        """Whether the server and every process it had at start are still running."""
        if server.proc is None or server.proc.poll() is not None:
            self.deaths.append(f"enginectl serve exited with {server.proc.returncode if server.proc else None}")
            return False
        for p in start.processes:
            if p["role"] == "EngineCore" and not psutil.pid_exists(p["pid"]):
                self.deaths.append(f"EngineCore pid {p['pid']} exited")
                return False
        if dead_line.is_set():
            self.deaths.append("the server logged EngineDeadError")
            return False
        return True

    def take(self, server: ServeProcess, label: str, t0: float, updater: Updater | None) -> Snapshot:
        """A snapshot between two updates (waits for the one running, bounded)."""
        held = updater is not None and updater.lock.acquire(timeout=UPDATE_TIMEOUT_S + 30)
        try:
            snap = snapshot(server, label, t0, during_update=updater is not None and not held)
            snap.updates = sum(updater.stats.ok.values()) if updater is not None else 0
        finally:
            if held and updater is not None:
                updater.lock.release()
        self.snapshots[label] = snap
        log(
            f"{label}: "
            + ", ".join(f"{p['role']} {p['rss_mib']} MiB {p['fds']} fds {p['threads']} threads" for p in snap.processes)
        )
        return snap

    def run(self) -> dict[str, Any]:
        t_begin = time.monotonic()
        root = Path(tempfile.mkdtemp(prefix="enginectl-soak-"))
        server = enginectl_server(
            [
                "--enable-scale-out",
                "--worker-id",
                WORKER_ID,
                "--allow-weights-from",
                str(root),
                "--fpm-subscriber-queue",
                str(FPM_SUBSCRIBER_QUEUE),
            ]
        )
        server.name = "enginectl-soak"
        startup_line = server.watch(HTTP_STARTUP_LINE)
        dead_line = server.watch(b"EngineDeadError")
        results: dict[str, Any] = {
            "machine": machine_info(),
            "repo": repo_info(),
            "config": {
                "duration_s": self.duration,
                "warmup_s": self.warmup,
                "rollout_threads": self.rollouts,
                "cas_writers": 2,
                "sources": list(self.sources),
                "fpm_subscriber_queue": FPM_SUBSCRIBER_QUEUE,
                "sample_interval_s": SAMPLE_INTERVAL_S,
                "update_timeout_s": UPDATE_TIMEOUT_S,
            },
        }
        trainer: Worker | None = None
        streams: Streams | None = None
        threads: list[threading.Thread] = []
        stop = threading.Event()
        try:
            log("starting enginectl serve")
            server.start()
            server.wait_ready()
            results["http_ready"] = wait_http_ready(server, startup_line)
            target, model = server.grpc_target, str(server.serving["model"])
            results["server"] = {k: server.serving.get(k) for k in ("model", "dp_size", "grpc_port", "http_port")}
            vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
            log(f"serving on {target}; building checkpoints A and B under {root}")
            trainer = Worker(
                ["--target", target, "--model", model, "--root", str(root), "--timeout", str(UPDATE_TIMEOUT_S)],
                module="bench.soak.trainer",
            )
            ready = trainer.expect("ready", 300)
            results["checkpoints"] = {"tensors": ready["tensors"], "bytes": ready["bytes"]}

            t0 = time.monotonic()
            start = self.take(server, "start", t0, None)
            streams = Streams(target, self.errors)
            streams.start()
            updater = Updater(target, trainer, ready["checkpoints"], self.sources, self.writes, self.errors)
            deadline = t0 + self.duration
            rollouts, r_lock = RolloutStats(), threading.Lock()
            cas, c_lock = CasStats(), threading.Lock()
            bound = int(self.duration * 200) + 100  # far above any rate here: time ends the loops
            threads = [
                *(
                    guarded(
                        f"rollout-{i}",
                        self.errors,
                        rollout_loop,
                        server.http_port,
                        vocab,
                        i,
                        stop,
                        deadline,
                        bound,
                        t0,
                        rollouts,
                        r_lock,
                        self.errors,
                    )
                    for i in range(self.rollouts)
                ),
                *(
                    guarded(
                        f"cas-{i}",
                        self.errors,
                        cas_loop,
                        target,
                        i,
                        stop,
                        deadline,
                        bound,
                        cas,
                        c_lock,
                        self.writes,
                        self.errors,
                    )
                    for i in range(2)
                ),
                guarded("updater", self.errors, updater.run, stop, deadline, bound),
            ]
            for t in threads:
                t.start()
            log(f"load running for {self.duration:.0f}s (warm-up {self.warmup:.0f}s)")

            warm_at, next_sample = t0 + self.warmup, t0
            while not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    break
                if not self.alive(server, start, dead_line):
                    log(f"engine died: {self.deaths[-1]}")
                    break
                if now >= next_sample:
                    s = snapshot(server, "series", t0)
                    self.series.append(
                        {
                            "t_s": s.t_s,
                            "rss_mib": {f"{p['role']} {p['pid']}": p["rss_mib"] for p in s.processes},
                            "fds": s.total("fds"),
                            "threads": s.total("threads"),
                            "rollouts": rollouts.completed,
                            "updates": sum(updater.stats.ok.values()),
                            "cas": cas.succeeded,
                            "errors": self.errors.total(),
                        }
                    )
                    log(
                        f"t={s.t_s:.0f}s rollouts {rollouts.completed}, updates {dict(updater.stats.ok)}, "
                        f"cas {cas.succeeded}/{cas.rounds}, errors {self.errors.total()}"
                    )
                    next_sample += SAMPLE_INTERVAL_S
                if "after_warmup" not in self.snapshots and now >= warm_at:
                    self.take(server, "after_warmup", t0, updater)
                wake = [deadline, next_sample, *([warm_at] if "after_warmup" not in self.snapshots else [])]
                stop.wait(max(0.0, min(wake) - time.monotonic()))
            engine_ok = not self.deaths and self.alive(server, start, dead_line)
            if engine_ok:
                self.take(server, "end", t0, updater)
            stop.set()
            for t in threads:
                t.join(UPDATE_TIMEOUT_S + 120)
            results["stuck_threads"] = [t.name for t in threads if t.is_alive()]
            streams.stop_subscribers()
            if engine_ok:
                with Client(target) as client:
                    final = client.get_weight_version()
                results["watch_caught_up"] = streams.wait_for_etag(final.etag, 60)
                results["final_revision"] = final.revision
                self.take(server, "idle_end", t0, updater)
            streams.close()
            results["load_s"] = round(time.monotonic() - t0, 1)
            results["rollouts"] = rollout_summary(rollouts, self.warmup)
            watched = {s.version for s in streams.states if s.version}
            results["rollouts"]["unknown_versions"] = sorted(rollouts.versions - watched - {VLLM_PLACEHOLDER})
            results["cas"] = asdict(cas)
            results["updates"] = update_summary(updater.stats)
            results["writes"] = verify_writes(self.writes.items, streams.states)
            results["watch"] = {"breaks": streams.watch_breaks, "churn": asdict(streams.watch_churn)}
            results["fpm"] = [asdict(s) for s in streams.fpm]
        except Exception as exc:  # noqa: BLE001 - the run failed before its end: say why in the results
            log(f"soak aborted: {exc!r}")
            results["crash"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            stop.set()
            if streams is not None and streams.loop.is_running():
                streams.close()
            if trainer is not None:
                results["trainer_exit"] = trainer.finish()
            results["server_stop"] = server.stop()
            shutil.rmtree(root, ignore_errors=True)
        results["errors"] = {"counts": dict(self.errors.counts), "examples": self.errors.examples}
        results["deaths"] = self.deaths
        results["snapshots"] = {k: asdict(v) for k, v in self.snapshots.items()}
        results["series"] = self.series
        results["elapsed_s"] = round(time.monotonic() - t_begin, 1)
        results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        results["checks"] = checks(results, self.errors, self.deaths, self.snapshots, self.series, self.sources)
        results["passed"] = all(c["ok"] for c in results["checks"])
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="fraction of the duration before the after-warm-up sample (default 0.2)",
    )
    parser.add_argument("--rollouts", type=int, default=3, choices=(2, 3, 4), help="rollout threads (default 3)")
    parser.add_argument(
        "--sources",
        default=",".join(SOURCES),
        help="update sources to rotate, comma-separated (default: all; fewer to bisect a leak)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    sources = tuple(s for s in args.sources.split(",") if s)
    if args.duration < 30 or not 0 < args.warmup < 1:
        parser.error("--duration must be at least 30 s and --warmup a fraction in (0, 1)")
    if not sources or set(sources) - set(SOURCES):
        parser.error(f"--sources: a comma-separated subset of {','.join(SOURCES)}")
    soak = Soak(args.duration, args.duration * args.warmup, args.rollouts, sources)
    results = soak.run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    md = markdown(results)
    (args.out / "latest.md").write_text(md)
    print(md)
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    log(
        f"done in {results['elapsed_s']}s; wrote {args.out / 'latest.json'} and latest.md; "
        + ("PASSED" if not failed else "FAILED: " + ", ".join(failed))
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
