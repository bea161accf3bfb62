"""After a load, before generation resumes: the model computes finite values, and nothing a
failed update left behind reaches the requests served after a successful one.

Runs INSIDE every vLLM worker process, mixed into the worker by `EnginectlWorkerExtension`
(worker/weights/extension.py); the server calls `enginectl_check_loaded` (WorkerRpc.CHECK_LOADED)
on every worker after every successful load, while generation is still paused
(server/weights/update/run.py). Who may touch the weights: the worker's RPC thread only, inside
`weight_access` (worker/weights/fingerprints.py).

Why (docs/weights.md, "Recovery after a partial update"):
- A load that stops part way leaves the parts of a partly loaded layer that never arrived as
  vLLM's layerwise reload materialised them: `torch.empty`, uninitialised memory, sometimes
  NaN. A later update that writes only some tensors does not repair them. So every load ends
  with a pass that every layer computes finite values: each tensor the model holds is reduced
  (`aminmax`: a NaN or an infinity anywhere shows, no finite sum can overflow), and each
  linear layer whose weight vLLM's CPU build packed into an opaque kernel is run on a fixed
  input (its output is finite only if every weight it multiplies is). One read of the weights
  (about 10 GB/s per core here; bench/README.md).
- Generation over such weights (after `ResumeGeneration(force=true)`) writes NaN into the KV
  cache. A prefix-cache reset frees those blocks but never clears them, and vLLM's CPU
  attention reads whole blocks: a NaN in a slot past a later request's end poisons it
  (0 x NaN), and a successful update then serves token 0 under a declared version. So an
  update that follows a partial one zeroes every KV-cache tensor, after the pause kept no
  request running on them (the server resets the prefix cache in the same update).
- Finite is not right: a layer the load wrote part of, or a kernel packed from other bytes
  than it received, computes finite garbage. So every layer the loads wrote is compared with
  what was written into it (worker/weights/written.py): a probe through each linear kernel
  against the output the written weight gives, a CRC of every readable tensor. First, the
  kernels vLLM's reload left stale are rebuilt: a tied LM head, whose weight the load wrote as
  the embedding's, keeps the kernel packed at start otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from enginectl.contract.engine import LoadCheck, wire
from enginectl.worker.weights.fingerprints import packed_linears, weight_access
from enginectl.worker.weights.ranks import place
from enginectl.worker.weights.written import (
    first_mismatch,
    first_partly_written,
    installed,
    probe,
    rebuild_tied_kernels,
)


class CheckMixin:
    """The worker RPC that checks a load (mixed into EnginectlWorkerExtension)."""

    def enginectl_check_loaded(self, clear_kv: bool) -> Any:
        """A LoadCheck: the first tensor or layer that computes a non-finite value, else the
        first layer that does not compute with what the loads wrote into it (written.py), and,
        with `clear_kv`, the KV-cache bytes zeroed first."""
        started = time.monotonic()
        where = place(self)
        cleared = 0
        with weight_access(self, "check loaded"):
            runner: Any = self.model_runner  # type: ignore[attr-defined]
            if clear_kv:
                cleared = zero_kv_caches(getattr(runner, "kv_caches", []))
            model = runner.get_model()
            recorded = installed()  # --load-check full (the default)
            rebuilt = tuple(rebuild_tied_kernels(model)) if recorded else ()
            # Memory no load wrote first (it may hold NaN: named for what it is), then
            # non-finite values (a trainer's NaN gives a NaN reference), then the rest; each
            # packed kernel runs once, its output on the probe kept for the comparison.
            outputs: dict[Any, torch.Tensor] = {}
            layer, why = first_partly_written(model) if recorded else ("", "")
            bad = "" if layer else first_not_finite(model, outputs)
            if recorded and not layer and not bad:
                with torch.inference_mode():
                    layer, why = first_mismatch(model, outputs)
        seconds = time.monotonic() - started
        return wire(LoadCheck(where.dp_rank, where.worker_rank, seconds, cleared, bad, layer, why, rebuilt))


def zero_kv_caches(caches: Any) -> int:
    """Zero every tensor of vLLM's per-layer KV caches (tensors, or lists of them); the bytes."""
    total = 0
    for tensor in _tensors(caches):
        tensor.zero_()
        total += tensor.numel() * tensor.element_size()
    return total


def first_not_finite(model: Any, outputs: dict[Any, torch.Tensor] | None = None) -> str:
    """The first tensor (by name) holding a NaN or an infinity, or packed linear layer whose
    output on its fixed +-1 probe does (every weight it multiplies counts); "" when every one
    is finite. Each packed layer's output goes into `outputs`, by module."""
    with torch.inference_mode():
        for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
            if tensor.numel() == 0 or tensor.is_meta or not tensor.is_floating_point():
                continue
            low, high = torch.aminmax(tensor.detach())
            if not (torch.isfinite(low) and torch.isfinite(high)):
                return name
        for name, module, in_features in packed_linears(model):
            weight = module.weight
            output = module.cpu_linear(probe(in_features, weight.dtype, weight.device), weight, None).reshape(-1)
            if outputs is not None:
                outputs[module] = output
            if not bool(torch.isfinite(output).all()):
                return name
    return ""


def _tensors(caches: Any) -> Iterator[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        yield caches
    elif isinstance(caches, (list, tuple)):
        for item in caches:
            yield from _tensors(item)
    elif isinstance(caches, dict):
        for item in caches.values():
            yield from _tensors(item)
