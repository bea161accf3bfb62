"""The bench's worker extension: enginectl's, plus one baseline measured inside the worker.

Runs INSIDE the vLLM worker of the weights bench's server only (bench/weights.py starts it
with `--worker-extension-cls bench.worker_ext.BenchWorkerExtension` and the repository on
PYTHONPATH); reached through vLLM's own /collective_rpc route (VLLM_SERVER_DEV_MODE=1), on
the worker's RPC thread, between forward passes, as every enginectl load is.

`bench_reload_in_memory(path)` is the floor of any update path that hands the worker tensors
already in memory: vLLM's `reload_weights(weights_iterator=...)` over tensors the worker
holds (read from `path` once, kept), timed inside the worker, with nothing around it (no
pause, no RPC, no cache reset). The same-host zero-copy update (UpdateWeightsFromIpc) is
measured against it.
"""

from __future__ import annotations

import time
from typing import Any

from enginectl.worker.weights.extension import EnginectlWorkerExtension


class BenchWorkerExtension(EnginectlWorkerExtension):
    def bench_reload_in_memory(self, path: str) -> float:
        """Seconds for reload_weights over the tensors of `path` (a .safetensors file) held in
        this worker's memory."""
        cached: dict[str, Any] | None = getattr(self, "_bench_tensors", None)
        if cached is None or getattr(self, "_bench_path", None) != path:
            from safetensors.torch import load_file

            cached = self._bench_tensors = {k: v.clone() for k, v in load_file(path).items()}
            self._bench_path = path
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(cached.items()))  # type: ignore[attr-defined]
        return time.perf_counter() - started
