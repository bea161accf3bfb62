"""A planner following the forward-pass metrics of several servers, reconciled against the
workers it expects.

Runs in a planner process; needs only enginectl's client (no torch, no vLLM). It opens one
StreamForwardPassMetrics per server (heartbeats included) through `Planner`
(client/planner.py), which reconnects and resumes on its own, and prints a report whenever
the verdict changes and at least every `--interval` seconds: the verdict with its detail, then
one line per data-parallel rank with the latest sample it sent and how old that is.
Samples without an expected worker id are shown as unattributed, never hidden.

    .venv/bin/python examples/planner_follow.py --targets 127.0.0.1:50051,127.0.0.1:50052 \
        --workers worker-a,worker-b --seconds 10

It stops after `--seconds`, or once every server has sent `--events` samples, whichever
comes first, prints a final report and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from enginectl.client import ChannelConfig, Planner, RankState, Reconciliation, Verdict

# Verdicts whose detail already counts the unattributed samples per endpoint.
COUNTED_IN_DETAIL = {Verdict.NO_FPM_DATA, Verdict.WORKER_COUNT_MISMATCH}


def rank_line(rank: RankState, expected: set[str]) -> str:
    s = rank.sample
    if s.worker_id in expected:
        who = f"worker {s.worker_id} (generation {s.identity_generation})"
    else:
        who = f"unattributed (worker id {s.worker_id!r})"
    state = "idle" if s.idle else f"running {s.num_running} waiting {s.num_waiting}"
    return (
        f"  {rank.endpoint} rank {rank.dp_rank}: {who}; {s.kind.value.lower()} {state}, "
        f"kv {s.kv_cache_usage:.0%}, weight revision {s.weight_revision}, seq {s.sequence}, age {rank.age_s:.1f}s"
    )


def report(planner: Planner, verdict: Reconciliation, expected: set[str], elapsed: float, label: str = "") -> None:
    lines = [f"[{elapsed:6.1f}s] {label}verdict {verdict.verdict.value}: {verdict.detail}"]
    lines += [rank_line(r, expected) for r in planner.fleet.latest()]
    loose = {e: n for e, n in verdict.unattributed.items() if n}
    if loose and verdict.verdict not in COUNTED_IN_DETAIL:
        lines.append(f"  unattributed samples so far: {', '.join(f'{e} {n}' for e, n in loose.items())}")
    for endpoint, status in planner.status.items():
        if not status.connected:
            why = f" ({status.last_error})" if status.last_error else ""
            lines.append(f"  {endpoint}: not connected, {status.reconnects} reconnects{why}")
    print("\n".join(lines), flush=True)


def fewest_samples(planner: Planner) -> int:
    """Samples received from the server that has sent the fewest."""
    return min(s.samples for s in planner.status.values())


async def follow(args: argparse.Namespace) -> None:
    expected = set(args.workers)
    token = os.environ.get("ENGINECTL_TOKEN")
    endpoints = [ChannelConfig(target=t, token=token) for t in args.targets]
    print(
        f"following {', '.join(args.targets)}; expecting workers {sorted(expected)} x {args.dp_size} rank(s), "
        f"stale after {args.stale_after}s",
        flush=True,
    )
    started = time.monotonic()
    deadline = started + args.seconds
    async with Planner(endpoints, stale_after=args.stale_after) as planner:
        shown: Verdict | None = None
        next_report = started
        while True:
            verdict = planner.reconcile(expected, args.dp_size)
            now = time.monotonic()
            done = now >= deadline or (args.events is not None and fewest_samples(planner) >= args.events)
            if done:
                report(planner, verdict, expected, now - started, "final ")
                return
            if verdict.verdict != shown or now >= next_report:
                report(planner, verdict, expected, now - started)
                shown, next_report = verdict.verdict, now + args.interval

            def changed(p: Planner, seen: Verdict | None = shown) -> bool:
                over = args.events is not None and fewest_samples(p) >= args.events
                return over or p.reconcile(expected, args.dp_size).verdict != seen

            await planner.wait_for(changed, max(0.0, min(next_report, deadline) - time.monotonic()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", required=True, help="comma-separated gRPC addresses of the servers")
    parser.add_argument("--workers", required=True, help="comma-separated worker ids the fleet should have")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per worker (default 1)")
    parser.add_argument("--events", type=int, default=None, help="stop once every server sent this many samples")
    parser.add_argument("--seconds", type=float, default=30.0, help="stop after this long (default %(default)s)")
    parser.add_argument("--interval", type=float, default=1.0, help="report at least this often (default 1 s)")
    parser.add_argument("--stale-after", type=float, default=5.0, help="a rank is stale after (default 5 s)")
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if not args.targets or not args.workers:
        parser.error("--targets and --workers need at least one entry each")
    if args.dp_size < 1 or args.seconds <= 0 or args.interval <= 0 or (args.events is not None and args.events < 1):
        parser.error("--dp-size, --events, --seconds and --interval must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    asyncio.run(follow(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
