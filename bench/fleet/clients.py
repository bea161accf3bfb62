"""Trainer side of the fleet bench (bench/fleet/phase.py): `python -m bench.fleet.clients MODE`.

Runs in subprocesses of `python -m bench` (torch is imported here only), speaking JSON lines
on stdout (bench/lib/lines.py):

- `build [--quick]`: build (once) the "few large" checkpoint (bench/lib/checkpoints.py); a
  `result` with its directory.
- `run --target A --target B --model DIR --reps N`: this process is the trainer. It joins
  one gloo group spanning both servers (`Fleet([A, B])`) and one with A alone
  (`Fleet([A])`), then, rep by rep, which goes first alternating, times on each fleet
  `stage_broadcast` of the checkpoint's tensors (ONE broadcast feeds every server of the
  fleet) and `commit(stage, mode="strict")` (pause all, commit each, resume all), from the
  first call to every server committed. Between them, the physical floor of the same
  question: a raw gloo broadcast of the same tensors from this process to 2 receiver
  processes vs to 1 (`gloo-recv`), into buffers allocated once, each ended by an allreduce
  that every receiver enters only once it has everything. One warm-up rep of each is not
  kept (the first stage and the first receive fault in fresh pages).
- `gloo-recv --join KIND=PORT:RANK:WORLD ... --file F --reps N`: a receiver of the raw
  broadcasts, following the same schedule as `run`.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import checkpoints
from bench.lib.lines import emit, report_errors

WARMUP_REPS = 1
TIMEOUT_S = 600.0
FLEETS = {"fleet_2": "bench-fleet-2", "fleet_1": "bench-fleet-1"}  # kind: its gloo group's name
RAW = {"raw_2": 2, "raw_1": 1}  # kind: receivers of a raw gloo broadcast


def schedule(rep: int) -> list[str]:
    """The kinds measured in rep `rep`, in order: fleets and raw broadcasts, 2 and 1
    interleaved, the order reversed every other rep so that neither always goes first."""
    kinds = ["fleet_2", "fleet_1", "raw_2", "raw_1"]
    return kinds if rep % 2 == 0 else kinds[::-1]


# -- raw gloo: the floor -----------------------------------------------------------------------
def gloo_recv(joins: dict[str, tuple[int, int, int]], file: str, reps: int) -> None:
    """Receive every raw broadcast of `schedule` this process is part of (`joins`: kind ->
    store port, rank, world size) into buffers allocated once."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        buffers = [torch.empty_like(f.get_tensor(k)) for k in f.keys()]  # safe_open is not a dict
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    groups: dict[str, Any] = {}
    for kind in RAW:  # in the trainer's order: creating a group blocks until all members joined
        if kind in joins:
            port, rank, world = joins[kind]
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
            groups[kind] = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, timeout)
    done = torch.zeros(1)
    for rep in range(reps):
        for kind in schedule(rep):
            if kind in groups:
                for b in buffers:
                    groups[kind].broadcast(b, 0).wait()
                groups[kind].allreduce([done]).wait()


class RawGloo:
    """This process as rank 0 of two raw gloo groups: with 1 receiver process and with 2."""

    def __init__(self, file: str, tensors: list[Any], reps: int) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self.tensors = torch, tensors
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        stores = {
            kind: dist.TCPStore("127.0.0.1", 0, n + 1, is_master=True, timeout=timeout, wait_for_workers=False)
            for kind, n in RAW.items()
        }
        joins = [
            ["--join", f"raw_2={stores['raw_2'].port}:1:3", "--join", f"raw_1={stores['raw_1'].port}:1:2"],
            ["--join", f"raw_2={stores['raw_2'].port}:2:3"],
        ]
        self.children = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.fleet.clients", "gloo-recv", *j, "--file", file, "--reps", str(reps)]
            )
            for j in joins
        ]
        try:
            self.groups: dict[str, Any] = {
                kind: dist.ProcessGroupGloo(dist.PrefixStore("raw", stores[kind]), 0, n + 1, timeout)
                for kind, n in RAW.items()
            }
        except BaseException:
            self.close(0)
            raise
        self._stores = stores  # the groups' rendezvous, kept for their lifetime

    def send(self, kind: str) -> float:
        """Seconds for one broadcast of every tensor, to the moment every receiver has it."""
        group = self.groups[kind]
        t0 = time.perf_counter()
        for t in self.tensors:
            group.broadcast(t, 0).wait()
        group.allreduce([self._torch.zeros(1)]).wait()
        return time.perf_counter() - t0

    def close(self, timeout: float = 60.0) -> None:
        """Reap the receivers (which end after the last rep); kill those still running after
        `timeout` (a run that failed half-way)."""
        for child in self.children:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)


# -- the fleets ------------------------------------------------------------------------------
def update(fleet: Any, named: list[tuple[str, Any]], version: str) -> dict[str, Any]:
    """One fleet update, timed: stage_broadcast, then a strict commit."""
    t0 = time.perf_counter()
    stage = fleet.stage_broadcast(named, version)
    t1 = time.perf_counter()
    commit = fleet.commit(stage, mode="strict")
    t2 = time.perf_counter()
    if stage.fingerprint is None:
        raise RuntimeError(f"{version}: the servers staged different bytes")
    return {
        "version": version,
        "stage_s": t1 - t0,
        "commit_s": t2 - t1,
        "total_s": t2 - t0,
        "staged": {t: s.name for t, s in stage.staged.items()},
        # the slowest server's commit, as it reports it (UpdateResult.duration)
        "server_commit_s": max(o.result.duration for o in commit.outcomes.values() if o.result is not None),
    }


def run(targets: list[str], model: Path, reps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from enginectl.client import Fleet
    from enginectl.client.trainer_tensors import named_tensors

    file = model / "model.safetensors"
    named = named_tensors(load_file(str(file)))
    total = WARMUP_REPS + reps
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in schedule(0)}
    raw = RawGloo(str(file), [t for _, t in named], total)
    fleets: dict[str, Any] = {}
    finished = False
    try:
        fleets.update(fleet_2=Fleet(targets, timeout=TIMEOUT_S), fleet_1=Fleet(targets[:1], timeout=TIMEOUT_S))
        offsets = {kind: f.init_weights_update_group(FLEETS[kind], timeout=120) for kind, f in fleets.items()}
        for rep in range(total):
            for kind in schedule(rep):
                if kind in fleets:
                    row = update(fleets[kind], named, f"{kind.replace('_', '')}-{rep}")
                else:
                    row = {"total_s": raw.send(kind)}
                if rep >= WARMUP_REPS:
                    rows[kind].append(row)
        finished = True
    finally:
        raw.close(60.0 if finished else 0.0)  # after a failure the receivers wait for nothing
        for kind, fleet in fleets.items():
            close_fleet(fleet, FLEETS[kind])
    return {
        "reps": rows,
        "rank_offsets": offsets,
        "num_tensors": len(named),
        "payload_bytes": sum(t.numel() * t.element_size() for _, t in named),
    }


def close_fleet(fleet: Any, group: str) -> None:
    """Destroy the fleet's group on every server (one that is gone has nothing to destroy),
    then close the fleet."""
    from enginectl.client import EnginectlError, TrainerClient

    try:
        for target in fleet.targets:
            with TrainerClient(target) as client:
                try:
                    client.destroy_weights_update_group(group, allow_missing=True)
                except EnginectlError:
                    pass
    finally:
        fleet.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet.clients")
    parser.add_argument("mode", choices=("build", "run", "gloo-recv"))
    parser.add_argument("--quick", action="store_true", help="build: the smoke-run checkpoint")
    parser.add_argument("--target", action="append", default=[])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--join", action="append", default=[], help="gloo-recv: KIND=PORT:RANK:WORLD")
    parser.add_argument("--file")
    args = parser.parse_args()
    if args.mode == "build":
        few_large = next(c for c in checkpoints.checkpoints(args.quick) if c.key == "few_large")
        return report_errors(lambda: emit("result", model=str(checkpoints.build(few_large))))
    if args.mode == "run":
        return report_errors(lambda: emit("result", **run(args.target, args.model, args.reps)))
    joins = {}
    for spec in args.join:
        kind, _, where = spec.partition("=")
        port, rank, world = (int(x) for x in where.split(":"))
        joins[kind] = (port, rank, world)
    return report_errors(lambda: gloo_recv(joins, args.file, args.reps))


if __name__ == "__main__":
    sys.exit(main())
