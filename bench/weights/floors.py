"""Physical floors of the weight-update bench (bench/README.md, figure 6), measured in the same run.

Runs in the `python -m bench.weights.clients run` process, on the machine the server runs on,
next to the measurements the floors bound:

- **memcpy**: a load, whatever carries the bytes (page cache, gloo, a gRPC stream), writes
  every byte of the payload into the model's parameters at least once. So no load beats
  `Tensor.copy_` of the checkpoint's own tensors into buffers allocated once: the first pass
  faults the buffers' pages in and is not timed; one pass is timed after every update rep
  (reused buffers, as a model's parameters are). Floor seconds = payload bytes / that
  bandwidth. One flat copy of the same byte count is timed too: the gap between the two is
  the cost of tensor count.
- **transport and load at once**: a gloo or tensor-stream update moves the bytes as its raw
  baseline does and loads them as `reload_weights` does; on a machine of two cores the two
  jobs slow each other down (a core, the memory bandwidth), so neither alone is its floor.
  The bench runs the raw transport (gloo in the client's 4 MiB buckets) with the in-memory
  reload (bench/lib/worker_ext.py, through /collective_rpc) started beside it, rep by rep, and
  times until both ended: an update that overlapped its receive and its load perfectly
  would take that long.
- **the declaration's fingerprint**: every update that declares a version records the
  fingerprint of the weights it loaded, in the same operation (the response carries it), and
  no baseline does: on vLLM's CPU build that is a gemv probe of every packed linear layer, a
  pass over every weight (docs/weights.md, "Threads and the weights"). The bench times a
  sampled VerifyWeights (the same digest, one gRPC call and one engine round trip) right
  after each baseline reload, on fresh kernels as after an update's load; baseline + that is
  the least an update that keeps the contract can take.
- **engine round trip**: PauseGeneration and ResumeGeneration each need at least one
  EngineCore utility round trip (vLLM's pause_scheduler, resume_scheduler) behind one gRPC
  call. GetGenerationState is one gRPC call that costs exactly one EngineCore utility round
  trip per DP rank (server/weights/update/generation.py `ranks`, server/engine.py
  `generation_state`; all ranks at once), so twice its p50, sampled between the pause reps,
  is the floor of a pause + resume round trip.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.lib.stats import summarize_ms


class MemcpyFloor:
    """`copy_` of a checkpoint's tensors into buffers allocated once, sampled between the reps
    of the updates it bounds (`sample`), so that it sees the same neighbours as they do.

    Each sample times one pass per thread count, 1 and torch's default: on a shared machine a
    parallel copy waits at a barrier for a descheduled thread, and a single-threaded one can be
    several times faster; the floor is the faster of the two (its median). `flat` copies the
    same byte count as one buffer."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        import torch

        self._torch = torch
        self.threads = sorted({1, torch.get_num_threads()})
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.count = len(tensors)
        buffers = [torch.empty_like(t) for t in tensors]
        src, dst = torch.ones(self.nbytes, dtype=torch.uint8), torch.empty(self.nbytes, dtype=torch.uint8)
        self._copies: dict[str, Callable[[], object]] = {
            "per_tensor": lambda: [b.copy_(t) for b, t in zip(buffers, tensors, strict=True)],
            "flat": lambda: dst.copy_(src),
        }
        self.times: dict[str, list[float]] = {f"{k}_{n}": [] for k in self._copies for n in self.threads}
        for copy in self._copies.values():
            copy()  # first pass, not timed: page faults of the fresh buffers

    def sample(self) -> None:
        default = self._torch.get_num_threads()
        try:
            for n in self.threads:
                self._torch.set_num_threads(n)
                for kind, copy in self._copies.items():
                    t0 = time.perf_counter()
                    copy()
                    self.times[f"{kind}_{n}"].append(time.perf_counter() - t0)
        finally:
            self._torch.set_num_threads(default)

    def result(self) -> dict[str, Any]:
        """The floor (the faster thread count's median per-tensor pass) and every series."""
        med = {k: statistics.median(v) for k, v in self.times.items()}
        best = min(self.threads, key=lambda n: med[f"per_tensor_{n}"])
        flat = min(med[f"flat_{n}"] for n in self.threads)
        floor_s = med[f"per_tensor_{best}"]
        return {
            "bytes": self.nbytes,
            "tensors": self.count,
            "passes": len(self.times[f"per_tensor_{best}"]),
            "torch_threads": best,
            "median_ms": round(floor_s * 1e3, 3),
            "min_ms": round(min(self.times[f"per_tensor_{best}"]) * 1e3, 3),
            "gb_per_s": round(self.nbytes / floor_s / 1e9, 3),
            "flat_median_ms": round(flat * 1e3, 3),
            "flat_gb_per_s": round(self.nbytes / flat / 1e9, 3),
            "series_median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        }


def engine_round_trips(get_state_times: Sequence[float]) -> dict[str, Any]:
    """The pause + resume floor from GetGenerationState wall times (seconds): 2 x its p50."""
    out: dict[str, Any] = dict(summarize_ms(get_state_times))
    out["floor_ms"] = round(2 * out["p50_ms"], 3)
    out["method"] = "2 x p50 of GetGenerationState (one gRPC call, one EngineCore utility round trip per rank)"
    return out
