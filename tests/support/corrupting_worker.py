"""A FAKE worker extension for tests/e2e/test_load_check.py: enginectl's own, plus a fault it
can be armed with: after the next load, one linear layer's kernel is rebuilt from other bytes
than the load wrote into it.

Why a fake: the check after every load (worker/weights/written.py) exists for weights that
compute other than what was received: a kernel packed from the wrong bytes, a kernel kept from
before the load. A real load does that only through a bug (vLLM 0.32 does it to a tied LM head;
the tiny test model has none), so the fault is made here on purpose, the way such a bug would
leave a layer: its packed kernel built by vLLM's own dispatch from a weight nobody sent. It
runs inside vLLM's worker process (`--worker-extension-cls
support.corrupting_worker.CorruptingWorkerExtension`, with tests/ on PYTHONPATH) and is
otherwise enginectl's extension, unchanged; it is armed through vLLM's own `/collective_rpc`.
"""

from __future__ import annotations

from typing import Any

import torch

from enginectl.worker.weights.extension import EnginectlWorkerExtension
from enginectl.worker.weights.fingerprints import weight_access

ARM = "enginectl_test_corrupt_after_next_load"


class CorruptingWorkerExtension(EnginectlWorkerExtension):
    def enginectl_test_corrupt_after_next_load(self, layer: str) -> None:
        self._enginectl_corrupt = layer

    def enginectl_load(self, plan_wire: Any) -> Any:
        answer = super().enginectl_load(plan_wire)
        layer, self._enginectl_corrupt = getattr(self, "_enginectl_corrupt", ""), ""
        if layer:
            with weight_access(self, "corrupt (a fake)"):
                repack_from_other_bytes(self.model_runner.get_model().get_submodule(layer))  # type: ignore[attr-defined]
        return answer


def repack_from_other_bytes(module: Any) -> None:
    """Build the layer's kernel, with vLLM's own dispatch, from finite weights of the right
    shape that nobody sent."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    shape = (module.output_size_per_partition, module.input_size_per_partition)
    generator = torch.Generator().manual_seed(7)
    other = (torch.randn(shape, generator=generator) * 0.05).to(module.weight.dtype)
    module.weight = torch.nn.Parameter(other, requires_grad=False)
    dispatch_cpu_unquantized_gemm(module, remove_weight=True)
