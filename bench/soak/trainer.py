"""Trainer side of the soak (bench/soak/run.py): `python -m bench.soak.trainer --target T --model DIR --root DIR`.

Runs in a subprocess of `python -m bench.soak`, so that torch lives here and not in the soak
process, and speaks JSON lines like the bench's other workers (bench/lib/procs.py `Worker`):

1. builds two safetensors checkpoints of the served tiny model under ROOT, as
   tests/weights_fixtures.py does: A is a copy of the model's files (the weights the server
   starts with), B the same files with every tensor perturbed (seeded); prints
   {"event": "ready", "checkpoints": {"A": dir, "B": dir}, "tensors": n, "bytes": n};
2. for each line `{"op": "tensors"|"gloo", "which": "A"|"B", "version": V}` on stdin, sends
   that checkpoint with `TrainerClient`: over the UpdateWeightsFromTensors stream, or through
   a fresh gloo group (InitWeightsUpdateGroup, broadcast, DestroyWeightsUpdateGroup: this
   process is rank 0 and hosts the group's TCPStore on 127.0.0.1), and prints
   {"event": "done", "ok": true, "revision", "version", "etag", "server_s", "pause_s"} or
   {"event": "done", "ok": false, "stage", "code", "reason", "message"};
3. exits at EOF on stdin. Anything else that goes wrong prints {"event": "error"} and exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench.lib.lines import emit, report_errors
from enginectl.client import EnginectlError, TrainerClient, UpdateResult

B_SEED = 1
B_NOISE = 0.5  # as tests/weights_fixtures.py: B's greedy tokens differ from A's
GROUP = "soak"


def build_checkpoints(model: Path, root: Path) -> dict[str, Path]:
    """A (copy of the served model's files) and B (every tensor perturbed) under `root`."""
    import torch
    from safetensors.torch import load_file, save_file

    a, b = root / "A", root / "B"
    shutil.copytree(model, a)
    shutil.copytree(model, b)
    generator = torch.Generator().manual_seed(B_SEED)
    state = load_file(str(a / "model.safetensors"))
    perturbed = {
        name: (t + B_NOISE * torch.randn(t.shape, generator=generator, dtype=t.dtype)).contiguous()
        for name, t in state.items()
    }
    save_file(perturbed, str(b / "model.safetensors"), metadata={"format": "pt"})
    return {"A": a, "B": b}


def ok(result: UpdateResult) -> dict[str, Any]:
    v = result.weight_version
    return {
        "ok": True,
        "revision": v.revision,
        "version": v.version,
        "etag": v.etag,
        "server_s": round(result.duration, 4),
        "pause_s": round(result.pause_duration, 4),
    }


def failed(stage: str, err: EnginectlError) -> dict[str, Any]:
    return {"ok": False, "stage": stage, "code": err.code.name, "reason": err.reason, "message": err.message[:300]}


def send_gloo(client: TrainerClient, tensors: dict[str, Any], version: str, timeout: float) -> dict[str, Any]:
    """One broadcast through a group made for it and destroyed after it (so that between
    updates no group exists, and a leak per group shows in the soak's fd/thread counts)."""
    try:
        client.init_weights_update_group(GROUP, timeout=timeout)
    except EnginectlError as err:
        return failed("init", err)
    try:
        out = ok(client.broadcast_weights(tensors, version, group_name=GROUP, timeout=timeout))
    except EnginectlError as err:
        out = failed("broadcast", err)
    try:
        client.destroy_weights_update_group(GROUP, allow_missing=True)
    except EnginectlError as err:
        if out["ok"]:
            out = failed("destroy", err)
    return out


def serve(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    paths = build_checkpoints(args.model, args.root)
    states = {which: load_file(str(path / "model.safetensors")) for which, path in paths.items()}
    emit(
        "ready",
        checkpoints={k: str(v) for k, v in paths.items()},
        tensors=len(states["A"]),
        bytes=sum(t.numel() * t.element_size() for t in states["A"].values()),
    )
    with TrainerClient(args.target) as client:
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            tensors, version = states[command["which"]], command["version"]
            if command["op"] == "tensors":
                try:
                    out = ok(client.update_weights_from_tensors(tensors, version, timeout=args.timeout))
                except EnginectlError as err:
                    out = failed("stream", err)
            elif command["op"] == "gloo":
                out = send_gloo(client, tensors, version, args.timeout)
            else:
                raise ValueError(f"unknown op {command['op']!r}")
            emit("done", **out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak.trainer")
    parser.add_argument("--target", required=True, help="the server's gRPC address (127.0.0.1:PORT)")
    parser.add_argument("--model", type=Path, required=True, help="the served model's directory")
    parser.add_argument("--root", type=Path, required=True, help="an allowed weights root (empty)")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound of each update, seconds")
    args = parser.parse_args(argv)
    return report_errors(lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
