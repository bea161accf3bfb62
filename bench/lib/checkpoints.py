"""The synthetic checkpoints of the weight-update bench (bench/weights/phase.py; bench/README.md, figure 6).

The specs are read by the `python -m bench` process; `build` runs in a `python -m
bench.weights.clients build` subprocess (torch is imported there only). Both checkpoints are
random float32 Llamas of about 200 MB, built once under bench/.cache (git-ignored) next to a
copy of the embedded tiny model's tokenizer, which vLLM loads like any model directory:

- **few large**: hidden 1024, 4 layers, 16 heads: 39 tensors, most of them 4 to 12 MB.
- **many small**: shaped like a real Llama scaled down: hidden 256, 54 layers, grouped-query
  attention (8 query heads, 2 KV heads; head_dim 32, the least vLLM's CPU attention takes),
  MLP 3.5x wide, vocabulary 8192: 489 tensors from 1 KB (RMSNorm weights) through 64 KB (k/v
  projections), 256 KB (q/o) and 896 KB (gate/up/down) to 8 MB (embeddings, lm_head).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"


@dataclass(frozen=True)
class Checkpoint:
    """One synthetic Llama: `key` names it in the results, `label` in the report."""

    key: str
    label: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int | None = None  # None: the tokenizer's own (512)

    @property
    def dir_name(self) -> str:
        vocab = f"-v{self.vocab}" if self.vocab else ""
        return f"llama-h{self.hidden}-i{self.intermediate}-a{self.heads}-kv{self.kv_heads}-l{self.layers}{vocab}"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shapes(self, vocab: int) -> dict[str, tuple[int, ...]]:
        """Every tensor's checkpoint name and shape, as Hugging Face's LlamaForCausalLM names them."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (vocab, h),
            "model.norm.weight": (h,),
            "lm_head.weight": (vocab, h),
        }
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (h, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, h)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate)
        return shapes


FULL = (
    Checkpoint("few_large", "few large", hidden=1024, intermediate=2816, heads=16, kv_heads=16, layers=4),
    Checkpoint("many_small", "many small", hidden=256, intermediate=896, heads=8, kv_heads=2, layers=54, vocab=8192),
)
QUICK = (  # smoke runs: ~60 MB and ~55 MB, the same tensor counts per layer
    Checkpoint("few_large", "few large", hidden=1024, intermediate=2816, heads=16, kv_heads=16, layers=1),
    Checkpoint("many_small", "many small", hidden=128, intermediate=448, heads=4, kv_heads=1, layers=54, vocab=8192),
)


def checkpoints(quick: bool) -> tuple[Checkpoint, ...]:
    return QUICK if quick else FULL


def build(ckpt: Checkpoint) -> Path:
    """The checkpoint's directory, built on first use (seeded: the same bytes every time)."""
    import torch
    from safetensors.torch import save_file

    from enginectl.server.default_model import ensure_default_model

    out = CACHE_DIR / ckpt.dir_name
    if (out / "model.safetensors").exists():
        return out
    tiny = ensure_default_model()
    tmp = CACHE_DIR / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    config = json.loads((tmp / "config.json").read_text())
    vocab = ckpt.vocab or int(config["vocab_size"])
    config.update(
        hidden_size=ckpt.hidden,
        intermediate_size=ckpt.intermediate,
        num_hidden_layers=ckpt.layers,
        num_attention_heads=ckpt.heads,
        num_key_value_heads=ckpt.kv_heads,
        head_dim=ckpt.head_dim,
        vocab_size=vocab,
        torch_dtype="float32",
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    state = {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        for name, shape in ckpt.shapes(vocab).items()
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, out)
    return out
