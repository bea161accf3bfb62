"""Load side of the two-phase update bench (bench/staging/phase.py): `python -m bench.staging.clients MODE`.

Runs in subprocesses of `python -m bench`, on the weights bench's server (bench/weights/phase.py),
speaking JSON lines on stdout (bench/lib/lines.py):

- `commit --target T --http-port P --served-model M --model DIR --reps N`: per rep, interleaved
  (which of the two goes first alternates), each while one long streaming rollout runs on
  vLLM's HTTP `/v1/completions`:
    commit    stage_weights_from_disk(DIR) with nothing running, then, once the rollout has
              its first tokens, commit_staged_weights (version `commit-<rep>`)
    reload    vLLM's reload_weights over the same tensors already in the worker's memory
              (bench/lib/worker_ext.py `bench_reload_in_memory`, through the dev-mode
              /collective_rpc route: no pause, no RPC of ours, no cache reset)
  and for each the longest gap between two streamed tokens that overlaps the call: how long
  the rollout saw no token. The server's own paused window of each commit is read by the
  orchestrator from its "weights updated" log line. Each rep also times the same reload over
  views of one flat buffer (`flat`, the staging buffer's layout), with no rollout.
- `stage-loop --target T --model DIR`: stage the checkpoint from disk and discard it, back
  to back, until told `stop` on stdin; `looping` once the first stage is done, then a
  `result` with every stage's wall time.
- `copy-loop --model DIR`: the control of stage-loop: the work of a worker's staging thread
  (worker/weights/staging.py: read the file's tensors, copy them into a freshly allocated
  buffer, CRC32 each) in this process instead, back to back, with the same protocol.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.lines import emit, report_errors
from bench.weights.clients import http_json

LEAD_TOKENS = 8  # tokens the rollout has before the call: it is generating, its KV cache is short
TAIL_TOKENS = 4  # tokens it gets after the call returns, to close the gap that spans it
MAX_TOKENS = 200  # fits the weights server's --max-model-len 256 with the prompt
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
STREAM_TIMEOUT_S = 120.0


@dataclass
class _Rollout:
    """One streaming /v1/completions request on its own thread, recording when each token
    (SSE event) arrived; it stops reading `TAIL_TOKENS` after `call_done` is set."""

    http_port: int
    served_model: str
    arrivals: list[float] = field(default_factory=list)
    lead: threading.Event = field(default_factory=threading.Event)
    call_done: threading.Event = field(default_factory=threading.Event)
    error: str = ""

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = json.dumps(
            {
                "model": self.served_model,
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "min_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
            }
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=STREAM_TIMEOUT_S)
        after = 0
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            while line := resp.readline():
                if line.startswith(b"data: [DONE]"):
                    return
                if not line.startswith(b"data: "):
                    continue
                self.arrivals.append(time.perf_counter())
                if len(self.arrivals) >= LEAD_TOKENS:
                    self.lead.set()
                if self.call_done.is_set():
                    after += 1
                    if after >= TAIL_TOKENS:
                        return  # closing the connection aborts the request in vLLM
        except Exception as exc:  # noqa: BLE001 - reported by spanning()
            self.error = repr(exc)[:300]
        finally:
            conn.close()
            self.lead.set()  # wake a waiter whatever happened

    def join(self) -> None:
        self._thread.join(STREAM_TIMEOUT_S)


def spanning(http_port: int, served_model: str, call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """`call()` made while a rollout streams: its result, its wall time, the longest gap
    between two tokens that overlaps the call, and the median gap before it (the rollout's
    normal pace). Raises when the rollout did not span the call."""
    rollout = _Rollout(http_port, served_model)
    if not rollout.lead.wait(STREAM_TIMEOUT_S) or len(rollout.arrivals) < LEAD_TOKENS:
        raise RuntimeError(f"the rollout never streamed {LEAD_TOKENS} tokens: {rollout.error}")
    began = time.perf_counter()
    result = call()
    ended = time.perf_counter()
    rollout.call_done.set()
    rollout.join()
    times = list(rollout.arrivals)
    if rollout.error or not times or times[-1] <= ended:
        raise RuntimeError(f"the rollout ended before the call did ({len(times)} tokens): {rollout.error}")
    pairs = list(zip(times, times[1:], strict=False))
    across = [b - a for a, b in pairs if b > began and a < ended]
    before = [b - a for a, b in pairs if b <= began]
    return result, {
        "call_s": ended - began,
        "gap_s": max(across),
        "steady_gap_s": statistics.median(before) if before else 0.0,
    }


def commit_reps(target: str, http_port: int, served_model: str, model: Path, reps: int) -> dict[str, Any]:
    """Interleaved commit and in-memory reload reps, each spanned by a rollout (module docstring)."""
    from enginectl.client import TrainerClient

    file = str(model / "model.safetensors")
    body = {"method": "bench_reload_in_memory", "kwargs": {"path": file}}
    http_json(http_port, "/collective_rpc", body)  # the worker holds the tensors from here on
    rows: dict[str, list[dict[str, Any]]] = {"commit": [], "reload": [], "flat": [], "keep_kv": []}
    with TrainerClient(target, timeout=600) as client:
        for i in range(reps):
            # The same commit without the prefix-cache reset: the rollout keeps its KV, so the
            # difference in token gap is the recompute the reset costs (bench/staging/phase.py).
            kept = client.stage_weights_from_disk(str(model), f"commit-keep-kv-{i}")

            def commit_keeping_kv(name: str = kept.name) -> Any:
                return client.commit_staged_weights(name, reset_prefix_cache=False)

            rows["keep_kv"].append(spanning(http_port, served_model, commit_keeping_kv)[1])
            t0 = time.perf_counter()
            staged = client.stage_weights_from_disk(str(model), f"commit-{i}")
            stage_s = time.perf_counter() - t0

            def commit(name: str = staged.name) -> Any:
                return client.commit_staged_weights(name)

            def reload() -> Any:
                return http_json(http_port, "/collective_rpc", body)

            flat = {**body, "kwargs": {"path": file, "flat": True}}
            rows["flat"].append(
                {"worker_s": max(float(r) for r in http_json(http_port, "/collective_rpc", flat)["results"])}
            )
            order = ("commit", "reload") if i % 2 == 0 else ("reload", "commit")
            for kind in order:
                result, view = spanning(http_port, served_model, commit if kind == "commit" else reload)
                if kind == "commit":
                    view.update(
                        version=f"commit-{i}",
                        stage_s=stage_s,
                        server_s=result.duration,
                        rank_load_s=result.ranks[0].duration,
                        reported_pause_s=result.pause_duration,
                    )
                else:
                    view["worker_s"] = max(float(r) for r in result["results"])
                rows[kind].append(view)
    return {"reps": rows, "lead_tokens": LEAD_TOKENS, "max_tokens": MAX_TOKENS}


def loop(once: Callable[[int], int]) -> None:
    """`once(i)` (which returns the bytes it moved) back to back until `stop` (or EOF) on
    stdin: `looping` after the first, then a `result` with every pass's wall time and the
    bytes per second moved between the first pass's end and the stop."""
    stop = threading.Event()

    def wait_stop() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_stop, daemon=True).start()
    passes: list[float] = []
    moved, looping = 0, 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        nbytes = once(len(passes))
        passes.append(time.perf_counter() - t0)
        if len(passes) == 1:
            emit("looping", pass_s=round(passes[0], 4))
            looping = time.perf_counter()
        else:
            moved += nbytes
    elapsed = time.perf_counter() - looping
    emit(
        "result",
        passes=len(passes),
        pass_s=[round(s, 4) for s in passes],
        gb_per_s=round(moved / elapsed / 1e9, 3) if elapsed else None,
    )


def stage_loop(target: str, model: Path) -> None:
    """Stage `model` from disk and discard it, back to back."""
    from enginectl.client import TrainerClient

    with TrainerClient(target, timeout=600) as client:

        def once(i: int) -> int:
            staged = client.stage_weights_from_disk(str(model), f"stage-{i}")
            client.discard_staged_weights(staged.name)
            return staged.bytes

        loop(once)


def copy_loop(model: Path) -> None:
    """The staging thread's work on `model` (disk read, copy into fresh pages, CRC32), here."""
    import zlib

    import torch
    from safetensors import safe_open

    file = str(model / "model.safetensors")
    with safe_open(file, framework="pt", device="cpu") as handle:
        total = sum(handle.get_tensor(name).nbytes for name in handle.keys())

    def once(i: int) -> int:
        buffer = torch.empty(total, dtype=torch.uint8)  # fresh pages, as a stage after a discard has
        ends, offset = [], 0
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                data = handle.get_tensor(name).reshape(-1).view(torch.uint8)
                buffer[offset : offset + data.numel()].copy_(data)
                offset += data.numel()
                ends.append(offset)
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # then the digest, as staging does
        for start, end in zip([0, *ends], ends, strict=False):
            zlib.crc32(view[start:end])
        return total

    loop(once)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.staging.clients")
    parser.add_argument("mode", choices=("commit", "stage-loop", "copy-loop"))
    parser.add_argument("--target")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--served-model")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "commit":
        return report_errors(
            lambda: emit("result", **commit_reps(args.target, args.http_port, args.served_model, args.model, args.reps))
        )
    if args.mode == "copy-loop":
        return report_errors(lambda: copy_loop(args.model))
    return report_errors(lambda: stage_loop(args.target, args.model))


if __name__ == "__main__":
    sys.exit(main())
