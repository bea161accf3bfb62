"""What every load wrote, layer by layer, so the check after it can show that the model
computes with the bytes it received (docs/weights.md, "The check after every load").

Runs INSIDE every vLLM worker process. vLLM's in-place reload (`reload_weights`, and the
transfer engines' start/finish) processes a layer once all of its elements were loaded, or at
the finalise for a layer that got fewer: `_layerwise_process` materialises the layer, replays
the loaders, lets the quantisation method turn the weight into its kernel form (on the CPU
build: a packed oneDNN or sgl kernel, the readable weight left empty) and copies the result
back. `install()` wraps that one function (vLLM 0.32's
vllm/model_executor/model_loader/reload/layerwise.py; it is looked up by name at each call) to
record, per layer processed:

- a layer the load wrote only part of (fewer elements than the layer holds, e.g. q_proj of a
  fused qkv_proj without k and v): the rest is what materialising left, `torch.empty`
  memory. Recorded as such; the check fails it;
- a linear layer (an unquantised linear or LM head): its output on a fixed +-1 probe from the
  weight as the loaders wrote it, before the kernel was built from it. The check runs the
  kernel itself (`quant_method.apply`) on the same probe: a kernel packed from other bytes, or
  kept from before the load, answers differently;
- every tensor of the layer still readable after processing: a CRC32 of its bytes.

A kernel that kept a readable weight and that no load processed is compared with that weight.
That is a tied LM head: vLLM 0.32's reload writes the embedding, never processes the LM head
(no checkpoint tensor names it) and leaves its kernel packed from the weights of the start;
`rebuild_tied_kernels` rebuilds it from the weight the load wrote, before the check.

Records outlive a load (a layer the next load does not write keeps its record, and is checked
against it again); a layer written again gets a new one. Who may touch them: the worker's RPC
thread, inside vLLM's reload or `weight_access` (worker/weights/fingerprints.py).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

import torch

from enginectl.worker.weights.fingerprints import tensor_bytes

# A kernel's output may differ from the reference by the rounding of bf16 (2^-8 of the value)
# and the order of its sums; a layer packed from other weights differs by its own magnitude.
RELATIVE_TOLERANCE = 2.0**-5


@dataclass
class Written:
    """What one load wrote into one layer (see the module docstring)."""

    partial: str = ""  # why the layer holds memory no load wrote, "" when it does not
    reference: torch.Tensor | None = None  # a linear layer's output on its probe, as written
    in_features: int = 0  # the probe's width (the weight may be empty once its kernel is built)
    crcs: dict[str, int] = field(default_factory=dict)  # readable tensor -> CRC32 of its bytes


# Every layer a load processed -> what it wrote (weak: a model freed frees its records).
WRITTEN: WeakKeyDictionary[torch.nn.Module, Written] = WeakKeyDictionary()
# Since the last check: the layers processed, and the storage of the tensors they wrote
# (`rebuild_tied_kernels`).
_PROCESSED: WeakSet[torch.nn.Module] = WeakSet()
_WRITTEN_STORAGE: set[int] = set()


def install() -> None:
    """Wrap vLLM's `_layerwise_process` to record what each layer was written; idempotent."""
    from vllm.model_executor.model_loader.reload import layerwise

    if installed():
        return
    layerwise._layerwise_process = _recording(layerwise._layerwise_process)  # type: ignore[assignment]


def installed() -> bool:
    """Whether loads are recorded in this process (`enginectl serve --load-check full`)."""
    from vllm.model_executor.model_loader.reload import layerwise

    return bool(getattr(layerwise._layerwise_process, "enginectl_records", False))


def _recording(process: Callable[[torch.nn.Module, Any], None]) -> Callable[[torch.nn.Module, Any], None]:
    def layerwise_process(layer: torch.nn.Module, info: Any) -> None:
        record = Written()
        total, loaded = info.load_numel_total or 0, info.load_numel
        if _is_linear(layer) and 0 < loaded < total:
            record.partial = f"the load wrote {loaded} of its {total} elements; the rest was never written"
        method: Any = getattr(layer, "quant_method", None)
        hooked = not record.partial and _linear_method(method)
        if hooked:
            # Between the replay of the loaders and the kernel's build: the weight as written.
            build = type(method).process_weights_after_loading

            def process_weights_after_loading(written: Any) -> None:
                weight: torch.Tensor = written.weight
                record.reference, record.in_features = _reference(weight), int(weight.shape[1])
                build(method, written)

            method.process_weights_after_loading = process_weights_after_loading
        try:
            process(layer, info)
        finally:
            if hooked:
                del method.process_weights_after_loading
        readable = _readable(layer)
        if not record.partial:
            record.crcs = {name: crc(t) for name, t in readable}
        WRITTEN[layer] = record
        _PROCESSED.add(layer)
        _WRITTEN_STORAGE.update(t.untyped_storage().data_ptr() for _, t in readable)

    layerwise_process.enginectl_records = True  # type: ignore[attr-defined]
    layerwise_process.__wrapped__ = process  # type: ignore[attr-defined]
    return layerwise_process


def rebuild_tied_kernels(model: Any) -> list[str]:
    """Rebuild the kernel of every layer the loads since the last call did not process but
    whose readable weight they wrote through another layer (a tied LM head: its weight is the
    embedding's), from that weight; the names. vLLM 0.32's reload processes only the layers a
    checkpoint tensor names, so without this a tied LM head keeps the kernel packed at start
    (docs/weights.md, "The check after every load")."""
    written = set(_WRITTEN_STORAGE)
    rebuilt = []
    for name, layer in sorted(model.named_modules()):
        if layer in _PROCESSED or not _kept_weight_kernel(layer):
            continue
        if layer.weight.untyped_storage().data_ptr() in written:
            with torch.no_grad():
                layer.quant_method.process_weights_after_loading(layer)
            rebuilt.append(name)
    _PROCESSED.clear()
    _WRITTEN_STORAGE.clear()
    return rebuilt


def first_partly_written(model: Any) -> tuple[str, str]:
    """(layer, why) for the first layer, by name, that holds memory no load wrote (what is
    there may be NaN or finite garbage: it is named as such either way); ("", "") if none."""
    for name, layer in sorted(model.named_modules()):
        record = WRITTEN.get(layer)
        if record is not None and record.partial:
            return name, record.partial
    return "", ""


def first_mismatch(model: Any, outputs: dict[Any, torch.Tensor] | None = None) -> tuple[str, str]:
    """(layer, why) for the first layer, by name, that does not compute with what was written
    into it; ("", "") when every one does. `outputs`: kernels' outputs on their probe already
    computed (checks.py `first_not_finite`), by module. Call under inference_mode, once every
    layer is known to compute finite values."""
    for name, layer in sorted(model.named_modules()):
        record = WRITTEN.get(layer)
        # A layer no load processed (a tied LM head) is compared with its readable weight.
        why = _stale_kernel(layer) if record is None else _differs(layer, record, (outputs or {}).get(layer))
        if why:
            return name, why
    return "", ""


def _differs(layer: torch.nn.Module, record: Written, output: torch.Tensor | None) -> str:
    if record.partial:
        return record.partial
    if record.reference is not None:
        why = _compare(_kernel_output(layer, record.in_features) if output is None else output, record.reference)
        if why:
            return f"its kernel {why} the weight it was written"
    for tensor_name, expected in record.crcs.items():
        tensor = getattr(layer, tensor_name, None)
        if isinstance(tensor, torch.Tensor) and crc(tensor) != expected:
            return f"{tensor_name} holds other bytes than the load wrote"
    return ""


def _stale_kernel(layer: torch.nn.Module) -> str:
    """A kernel that kept its readable weight (an LM head's) computes with that weight."""
    if not _kept_weight_kernel(layer):
        return ""
    weight: Any = layer.weight
    why = _compare(_kernel_output(layer, weight.shape[1]), _reference(weight))
    return f"its kernel {why} its weight (a kernel built before the load)" if why else ""


def _kept_weight_kernel(layer: torch.nn.Module) -> bool:
    """A packed kernel (vLLM's CPU build) beside a readable 2-D weight, of a plain matmul."""
    weight = getattr(layer, "weight", None)
    return (
        getattr(layer, "cpu_linear", None) is not None
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.numel() > 0
        and _linear_method(getattr(layer, "quant_method", None))
    )


def _compare(output: torch.Tensor, reference: torch.Tensor) -> str:
    error = float((output.float() - reference).abs().max())
    scale = float(reference.abs().max()) + 1e-6
    return "" if error <= RELATIVE_TOLERANCE * scale else f"differs by {error:.3g} (of {scale:.3g}) from"


def _kernel_output(layer: Any, in_features: int) -> torch.Tensor:
    signs = probe(in_features, layer.weight.dtype, layer.weight.device)
    return layer.quant_method.apply(layer, signs).reshape(-1)


def _reference(weight: torch.Tensor) -> torch.Tensor:
    signs = probe(weight.shape[1], weight.dtype, weight.device)
    return torch.nn.functional.linear(signs, weight).float().reshape(-1)


@functools.lru_cache(maxsize=256)
def probe(in_features: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed +-1 input (exact in every float type), one per width."""
    generator = torch.Generator().manual_seed(in_features)
    signs = torch.randint(0, 2, (1, in_features), generator=generator) * 2 - 1
    return signs.to(dtype=dtype, device=device)


@functools.cache
def _vllm_types() -> tuple[type, tuple[type, ...]]:
    """vLLM's linear layer base, and its unquantised methods (imported once, not per layer)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return LinearBase, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def _is_linear(layer: torch.nn.Module) -> bool:
    return isinstance(layer, _vllm_types()[0])


def _linear_method(method: Any) -> bool:
    """An unquantised linear or embedding method: its `apply` is a plain matmul of the weight."""
    return isinstance(method, _vllm_types()[1])


def _readable(layer: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, tensor)
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        if tensor is not None and tensor.numel() > 0 and not tensor.is_meta
    ]


def crc(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (about 4 GB/s here), as the full fingerprint reads them."""
    return zlib.crc32(tensor_bytes(tensor if tensor.device.type == "cpu" else tensor.cpu()))
