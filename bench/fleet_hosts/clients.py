"""The trainer of phase `fleet_hosts` (bench/fleet_hosts/phase.py), speaking JSON lines
(bench/lib/lines.py): `python -m bench.fleet_hosts.clients run --fleet NAME=A,B@MASTER ...`.

This process is the trainer of both fleets (`Fleet([A, B], token=...)`), each with its own
broadcast group hosted at its MASTER address (127.0.0.1 for the one-host fleet, this host's
address on the bridge for the other). After one warm-up rep of each kind (not kept), rep by
rep with the fleets' order alternating (ABBA), it times on each fleet:

- `broadcast`: `stage_broadcast` of the served model's own tensors (one gloo broadcast feeds
  both servers' workers) and a strict `commit` (pause both, commit each, resume both);
- `tensors`: `stage_from_tensors` (a tensor stream to each server) and a strict `commit`;
- `status`: `Fleet.status()` (every server's version, generation state and health).

Every commit must report every tensor loaded on each server's rank (or the run fails).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.lines import emit, report_errors
from bench.lib.stats import median_ms

KINDS = ("broadcast", "tensors", "status")
TIMEOUT_S = 600.0


def _committed(commit: Any, count: int) -> None:
    for target, outcome in commit.outcomes.items():
        if outcome.result is None or [r.tensors_loaded for r in outcome.result.ranks] != [count]:
            raise RuntimeError(f"{target}: not every tensor loaded: {outcome}")


def cmd_run(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from enginectl.client import Fleet

    fleets_given = {}
    for spec in args.fleet:
        name, _, rest = spec.partition("=")
        targets, _, master = rest.partition("@")
        fleets_given[name] = (targets.split(","), master)
    state = dict(load_file(str(Path(args.model) / "model.safetensors")))
    fleets = {n: Fleet(t, token=args.token, timeout=TIMEOUT_S) for n, (t, _) in fleets_given.items()}
    runs: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in fleets}
    try:
        offsets = {
            n: fleets[n].init_weights_update_group(f"bench-{n}", master_address=m, timeout=120)
            for n, (_, m) in fleets_given.items()
        }
        for rep in range(-1, args.reps):  # -1: the warm-up, not kept
            names = list(fleets) if rep % 2 == 0 else list(reversed(fleets))
            for name in names:
                fleet = fleets[name]
                kept = runs[name] if rep >= 0 else {k: [] for k in KINDS}
                t0 = time.perf_counter()
                commit = fleet.commit(fleet.stage_broadcast(state, f"bcast-{name}-{rep}", timeout=TIMEOUT_S))
                kept["broadcast"].append(time.perf_counter() - t0)
                _committed(commit, len(state))
                t0 = time.perf_counter()
                commit = fleet.commit(fleet.stage_from_tensors(state, f"stream-{name}-{rep}", timeout=TIMEOUT_S))
                kept["tensors"].append(time.perf_counter() - t0)
                _committed(commit, len(state))
                t0 = time.perf_counter()
                status = fleet.status()
                kept["status"].append(time.perf_counter() - t0)
                if not status.consistent:
                    raise RuntimeError(f"{name}: the fleet is not consistent: {status}")
    finally:
        for name, fleet in fleets.items():
            try:
                fleet.destroy_weights_update_group(f"bench-{name}")
            finally:
                fleet.close()
    emit(
        "result",
        reps=args.reps,
        num_tensors=len(state),
        payload_bytes=sum(t.numel() * t.element_size() for t in state.values()),
        rank_offsets=offsets,
        **{kind: {n: median_ms(r[kind]) for n, r in runs.items()} for kind in KINDS},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_hosts.clients")
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--fleet", action="append", required=True, help="NAME=A,B@MASTER_ADDRESS (repeatable)")
    run.add_argument("--model", required=True)
    run.add_argument("--token", required=True)
    run.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    return report_errors(lambda: cmd_run(args))


if __name__ == "__main__":
    sys.exit(main())
