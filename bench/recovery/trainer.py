"""Trainer side of the recovery soak (bench/recovery/run.py), in its own process so that torch
stays out of the soak's. Two commands, speaking JSON lines as the bench's other workers
(bench/lib/procs.py `Worker`):

`python -m bench.recovery.trainer serve --target T --model DIR --root DIR`:

1. builds checkpoints A (a copy of the served model's files) and B (every tensor perturbed,
   seeded) under ROOT with bench/soak/trainer.py's `build_checkpoints`, and a poisoned copy
   of each, "A-nan" and "B-nan" (`poison`: NaN in the first column of every tensor, for the
   partial updates of weights that compute NaN); prints
   {"event": "ready", "checkpoints": {"A": dir, "B": dir, "A-nan": dir, "B-nan": dir},
   "tensors": n, "bytes": n};
2. for each line on stdin:
   - `{"op": "update", "source": S, "which": "A"|"B", "version": V}`: a full update of that
     checkpoint through S: "tensors" (the UpdateWeightsFromTensors stream), "gloo" (a
     broadcast through a fresh group, destroyed after it), "ipc" (UpdateWeightsFromIpc:
     the tensors by reference, from shared memory) or "transfer" (a round of vLLM's
     weight-transfer API through enginectl's `gloo` engine and WeightSyncClient: the server
     runs with `--weight-transfer-config '{"backend": "gloo"}'`; the engine is set up on
     first use and kept). Prints {"event": "done", "ok": true, "version", "revision"} or
     {"event": "done", "ok": false, "code", "reason", "cause", "message"};
   - `{"op": "break", "source": "ipc", "which", "version", "at_once": bool}`: an IPC update
     cancelled at once or once it wrote a tensor (bench/recovery/breaks.py);
   - `{"op": "break", "source": "transfer", "which", "version", "count": k, "step_timeout": s}`:
     a transfer round that starts, sends one batch of the first k tensors and goes away (no
     finish): the server fails it TRANSFER_STEP_TIMEOUT after s seconds. The `gloo` engine
     applies a round at its finish only, so this one never writes (a clean refusal);
   and prints {"event": "broken", "operation": name} (the soak waits for the Operation);
3. exits at EOF on stdin.

`python -m bench.recovery.trainer die-mid-broadcast --target T --file F --group G --version V
--count K --timeout S`: a trainer that dies mid-broadcast (as tests/support/fault_procs.py
"broadcast"): InitWeightsUpdateGroup G (rank 0, hosting its TCPStore), then an
UpdateWeightsFromDistributed of F's tensors (update timeout S, one collective per tensor),
broadcasts the first K, prints {"event": "sent", "operation": name, "sent": K} and blocks on
stdin until the soak kills it (SIGKILL).

An update the server fails, or one that fails on the trainer's own side (a gloo group, torch's
shared-memory manager: the tensors are moved into shared memory once, before "ready"), is
answered in its line with "ok": false (a break with "operation": ""), and the trainer serves
on; anything else prints {"event": "error"} and exits 1 (bench/lib/lines.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.lib.lines import emit, report_errors
from bench.recovery.breaks import cancel_once_written
from bench.soak.trainer import build_checkpoints
from enginectl.client import EnginectlError, TrainerClient, UpdateResult

UPDATE_SOURCES = ("tensors", "gloo", "ipc", "transfer")
# Failures of the trainer's own side: a gloo group (RuntimeError, TimeoutError), torch's
# shared-memory manager (ValueError from trainer_ipc.py), a connection (OSError).
CLIENT_ERRORS = (RuntimeError, TimeoutError, ValueError, OSError)
SHARE_ATTEMPTS = 3
TRANSFER_STEP_TIMEOUT_S = 60.0  # a full transfer round's wait for the trainer's next step
JOIN_TIMEOUT_S = 60.0  # a group's rendezvous


def poison(src: Path, dst: Path) -> None:
    """A copy of checkpoint `src` at `dst` with NaN in the first column of every tensor (the
    first element of a 1-D one): any tensor of it makes every hidden state NaN (a norm weight,
    the embeddings' first feature, a projection's first input), as a trainer that diverged
    would send; the LM head alone makes every logit NaN."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for tensor in state.values():
        tensor[..., 0] = float("nan")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def done_ok(result: UpdateResult) -> dict[str, Any]:
    v = result.weight_version
    return {"ok": True, "version": v.version, "revision": v.revision, "server_s": round(result.duration, 4)}


def done_failed(err: EnginectlError) -> dict[str, Any]:
    return {
        "ok": False,
        "code": err.code.name,
        "reason": err.reason,
        "cause": err.metadata.get("cause", ""),
        "message": err.message[:300],
    }


class Transfer:
    """The trainer's `gloo` weight-transfer engine (vLLM's trainer-side API), set up on first
    use and kept across rounds; set up again after a round that broke its group."""

    def __init__(self, target: str, num_workers: int, timeout: float) -> None:
        from enginectl.client.transfer_client import WeightSyncClient

        self.target, self.num_workers, self.timeout = target, num_workers, timeout
        self.sync = WeightSyncClient(target, timeout=timeout, step_timeout=TRANSFER_STEP_TIMEOUT_S)
        self.engine: Any = None

    def _ready(self, tensors: dict[str, Any]) -> Any:
        """The engine, with `tensors` as the source of its next round."""
        from enginectl.client.transfer_engine import (
            GlooTrainerInitInfo,
            GlooTrainerWeightTransferEngine,
            StateDictSource,
        )

        source = StateDictSource(tensors)
        if self.engine is not None and self.engine.group is not None and self.engine.group.pg is not None:
            self.engine.source = source
            return self.engine
        if self.engine is not None:  # its group broke: both sides start afresh
            self.engine.shutdown()
            self.sync.shutdown_weight_transfer_engine()
        self.engine = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(
                master_address="127.0.0.1",
                master_port=0,
                world_size=1 + self.num_workers,
                rank=0,
                timeout_s=JOIN_TIMEOUT_S,
                bucket_bytes=0,
            ),
            client=self.sync,
            source=source,
        )
        return self.engine

    def update(self, tensors: dict[str, Any], version: str) -> UpdateResult:
        engine = self._ready(tensors)
        engine.send_weights(weight_version=version)
        assert self.sync.last_result is not None
        return self.sync.last_result

    def break_round(self, tensors: dict[str, Any], count: int, step_timeout: float) -> str:
        """Start a round, send one batch of the first `count` tensors (received beside its
        broadcast), and go away; the round's Operation."""
        from enginectl.client.transfer_client import WeightSyncClient
        from enginectl.common.buckets import cut

        engine = self._ready(tensors)
        pairs = list(tensors.items())[:count]
        values = [t.contiguous() for _, t in pairs]
        info = {
            "names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in values],
            "shapes": [list(t.shape) for t in values],
            "bucket_bytes": engine.bucket_bytes,
        }
        quick = WeightSyncClient(self.target, timeout=self.timeout, step_timeout=step_timeout)
        try:
            quick.start_weight_update()
            errors: list[BaseException] = []

            def receive() -> None:
                try:
                    quick.update_weights(info)
                except BaseException as exc:  # noqa: BLE001 - raised below
                    errors.append(exc)

            thread = threading.Thread(target=receive, name="transfer-batch", daemon=True)
            thread.start()
            engine.group.broadcast(values, cut([t.numel() * t.element_size() for t in values], engine.bucket_bytes))
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive() or errors:
                raise RuntimeError(f"the transfer batch was not received: {errors or 'timed out'}")
            return quick.operation
        finally:
            quick.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            try:
                self.sync.shutdown_weight_transfer_engine()
            except EnginectlError:
                pass
        self.sync.close()


def send_gloo(client: TrainerClient, tensors: dict[str, Any], version: str, group: str, timeout: float) -> UpdateResult:
    """One broadcast through a group made for it, destroyed after it (also when it failed)."""
    client.init_weights_update_group(group, timeout=JOIN_TIMEOUT_S)
    try:
        return client.broadcast_weights(tensors, version, group_name=group, timeout=timeout)
    finally:
        client.destroy_weights_update_group(group, allow_missing=True)


def start_ipc(target: str, tensors: dict[str, Any], version: str, timeout: float) -> str:
    """UpdateWeightsFromIpc of `tensors` (shared on first use), started: its Operation's name.
    The tensors stay alive in the caller (the engine reads them until the update ends)."""
    import grpc

    from enginectl.client.trainer_ipc import ipc_request
    from enginectl.client.trainer_requests import UpdateOptions
    from enginectl.client.trainer_tensors import named_tensors
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

    request = UpdateOptions(version, timeout=timeout).fill(ipc_request(named_tensors(tensors, device=None), 0))
    with grpc.insecure_channel(target) as channel:
        return str(pb2_grpc.WeightUpdateServiceStub(channel).UpdateWeightsFromIpc(request, timeout=60).name)


def share(states: dict[str, dict[str, Any]]) -> None:
    """Move every checkpoint's tensors into shared memory now, once (IPC updates send them by
    reference; a tensor shared already is not shared again): torch's shared-memory manager
    may time out on a busy machine, which is retried here rather than failing an update."""
    from enginectl.client.trainer_ipc import ipc_request
    from enginectl.client.trainer_tensors import named_tensors

    for state in states.values():
        for attempt in range(SHARE_ATTEMPTS):
            try:
                ipc_request(named_tensors(state, device=None), 0)
                break
            except ValueError:
                if attempt == SHARE_ATTEMPTS - 1:
                    raise


class Trainer:
    """The `serve` command's updates, over one TrainerClient and the checkpoints' tensors."""

    def __init__(self, client: TrainerClient, states: dict[str, dict[str, Any]], target: str, timeout: float) -> None:
        self.client, self.states, self.target, self.timeout = client, states, target, timeout
        self.transfer = Transfer(target, client.get_server_info().num_workers, timeout)
        self.groups = 0

    def update(self, source: str, tensors: dict[str, Any], version: str) -> UpdateResult:
        if source == "tensors":
            return self.client.update_weights_from_tensors(tensors, version, timeout=self.timeout)
        if source == "gloo":
            self.groups += 1
            return send_gloo(self.client, tensors, version, f"recovery-{self.groups}", self.timeout)
        if source == "ipc":
            return self.client.update_weights_from_ipc(tensors, version, timeout=self.timeout)
        return self.transfer.update(tensors, version)

    def break_update(self, source: str, tensors: dict[str, Any], version: str, command: dict[str, Any]) -> str:
        """An update started and broken part way (see the module docstring): its Operation."""
        if source == "ipc":
            name = start_ipc(self.target, tensors, version, self.timeout)
            cancel_once_written(self.client, name, bool(command["at_once"]), time.monotonic() + self.timeout)
            return name
        return self.transfer.break_round(tensors, int(command["count"]), float(command["step_timeout"]))

    def handle(self, command: dict[str, Any]) -> None:
        """One command, answered with one line; a failure of the trainer's own side (a group,
        shared memory) is answered too, and the trainer serves on."""
        op, source = command["op"], command["source"]
        tensors, version = self.states[command["which"]], command["version"]
        if (op, source) not in {("update", s) for s in UPDATE_SOURCES} | {("break", "ipc"), ("break", "transfer")}:
            raise ValueError(f"unknown command {command!r}")
        try:
            if op == "update":
                emit("done", **done_ok(self.update(source, tensors, version)))
            else:
                emit("broken", operation=self.break_update(source, tensors, version, command))
        except EnginectlError as err:
            emit("done" if op == "update" else "broken", **done_failed(err), operation="")
        except CLIENT_ERRORS as exc:
            failure = {"ok": False, "code": "CLIENT", "reason": type(exc).__name__, "cause": ""}
            emit("done" if op == "update" else "broken", **failure, message=str(exc)[:300], operation="")

    def close(self) -> None:
        self.transfer.close()


def serve(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    paths = build_checkpoints(args.model, args.root)
    for which in ("A", "B"):
        paths[f"{which}-nan"] = args.root / f"{which}-nan"
        poison(paths[which], paths[f"{which}-nan"])
    states = {which: load_file(str(path / "model.safetensors")) for which, path in paths.items()}
    share(states)
    emit(
        "ready",
        checkpoints={k: str(v) for k, v in paths.items()},
        tensors=len(states["A"]),
        bytes=sum(t.numel() * t.element_size() for t in states["A"].values()),
    )
    with TrainerClient(args.target, timeout=args.timeout) as client:
        trainer = Trainer(client, states, args.target, args.timeout)
        try:
            for line in sys.stdin:
                if line.strip():
                    trainer.handle(json.loads(line))
        finally:
            trainer.close()


def die_mid_broadcast(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(args.file))
    client = TrainerClient(args.target)
    client.init_weights_update_group(args.group, timeout=JOIN_TIMEOUT_S)
    started = client.start_broadcast(tensors, args.version, group_name=args.group, timeout=args.timeout, bucket_bytes=0)
    if args.count:
        started.send(args.count)
    emit("sent", operation=started.name, sent=args.count)
    sys.stdin.read()  # killed here


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery.trainer")
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("serve", help="build the checkpoints, then run the soak's updates")
    s.add_argument("--target", required=True, help="the server's gRPC address (127.0.0.1:PORT)")
    s.add_argument("--model", type=Path, required=True, help="the served model's directory")
    s.add_argument("--root", type=Path, required=True, help="an allowed weights root (empty)")
    s.add_argument("--timeout", type=float, default=120.0, help="bound of each update, seconds")
    d = commands.add_parser("die-mid-broadcast", help="broadcast K tensors of a checkpoint, then wait to be killed")
    d.add_argument("--target", required=True)
    d.add_argument("--file", type=Path, required=True, help="the checkpoint's safetensors file")
    d.add_argument("--group", required=True)
    d.add_argument("--version", required=True)
    d.add_argument("--count", type=int, required=True)
    d.add_argument("--timeout", type=float, default=30.0, help="the update's timeout, seconds")
    args = parser.parse_args(argv)
    return report_errors(lambda: serve(args) if args.command == "serve" else die_mid_broadcast(args))


if __name__ == "__main__":
    sys.exit(main())
