"""The bench's worker extension: enginectl's, plus one baseline measured inside the worker.

Runs INSIDE the vLLM worker of the weights bench's server only (bench/weights/phase.py starts it
with `--worker-extension-cls bench.lib.worker_ext.BenchWorkerExtension` and the repository on
PYTHONPATH); reached through vLLM's own /collective_rpc route (VLLM_SERVER_DEV_MODE=1), on
the worker's RPC thread, between forward passes, as every enginectl load is.

`bench_reload_in_memory(path)` is the floor of any update path that hands the worker tensors
already in memory: vLLM's `reload_weights(weights_iterator=...)` over tensors the worker
holds (read from `path` once, kept), timed inside the worker, with nothing around it (no
pause, no RPC, no cache reset). The same-host zero-copy update (UpdateWeightsFromIpc) and
the commit of staged weights (bench/staging/phase.py) are measured against it. With `flat=True` the
tensors are views of one uint8 buffer, back to back in file order, as a commit hands them
over from the worker's staging buffer (worker/weights/staging.py): the same reload, with only
the commit's memory layout, to tell the layout's cost from the rest of a commit's load.
"""

from __future__ import annotations

import time

import torch

from enginectl.worker.weights.extension import EnginectlWorkerExtension


class BenchWorkerExtension(EnginectlWorkerExtension):
    def bench_reload_in_memory(self, path: str, flat: bool = False) -> float:
        """Seconds for reload_weights over the tensors of `path` (a .safetensors file) held in
        this worker's memory (`flat`: as views of one buffer)."""
        held: dict[tuple[str, bool], dict[str, torch.Tensor]] = self.__dict__.setdefault("_bench_tensors", {})
        cached = held.get((path, flat))
        if cached is None:
            from safetensors.torch import load_file

            loaded = load_file(path)
            cached = held[path, flat] = _flat_views(loaded) if flat else {k: v.clone() for k, v in loaded.items()}
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(cached.items()))  # type: ignore[attr-defined]
        return time.perf_counter() - started


def _flat_views(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `tensors` as views of one uint8 buffer, back to back (the staging layout)."""
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)
    views, offset = {}, 0
    for (name, tensor), size in zip(tensors.items(), sizes, strict=True):
        raw = buffer[offset : offset + size]
        raw.copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        views[name] = raw.view(tensor.dtype).reshape(tensor.shape)
        offset += size
    return views
