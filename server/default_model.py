"""Build (once) and locate the tiny random Llama that ``enginectl serve`` runs by default.

This module runs inside the ``enginectl serve`` process, next to the vLLM engine.
When no model is given on the command line, the server still needs something vLLM
can load, without network access and without shipping weights in the repository.
So we build a tiny Llama on first use: a byte-level BPE tokenizer trained on a few
KB of text embedded below, and a randomly initialised (seeded) ``LlamaForCausalLM``.
The result is cached on disk and reused; it is deterministic, so every machine and
every rebuild produces the same bytes, which keeps tests and benchmarks comparable.

The outputs are gibberish by design: the model exists to exercise the engine and
control plane (scheduling, streaming, cancellation), not to say anything useful.

Heavy libraries (torch, transformers, tokenizers) are imported only inside the
build, so importing this module stays cheap for the CLI and the fast path.

It also holds the other defaults a start fills in when the user left them out: the short
name the embedded model is served under (``SERVED_MODEL_NAME``), and, on vLLM's CPU build, a
KV-cache size for a user's own model that fits the machine (``cpu_kv_cache_default``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "KV_CACHE_CAP_BYTES",
    "MODEL_DIR_NAME",
    "SERVED_MODEL_NAME",
    "KvCacheDefault",
    "cpu_kv_cache_bytes",
    "cpu_kv_cache_default",
    "default_cache_dir",
    "ensure_default_model",
    "memory_flags_unset",
]

# The name the embedded model is served under (vLLM's --served-model-name), unless the user
# passes their own: what /v1/models lists and what a request's "model" names.
SERVED_MODEL_NAME = "enginectl-tiny"

# Bump RECIPE_VERSION for changes the hash below cannot see (e.g. build code changes).
RECIPE_VERSION = 1

# Everything that determines the model's bytes. Its hash names the cache folder, so
# editing any of these values makes the next call build a fresh model next to the old.
_RECIPE: dict[str, Any] = {
    "seed": 0,
    "tokenizer": {
        "vocab_size": 512,
        "min_frequency": 2,
        # ids 0..3, in this order: unk, bos, eos, pad.
        "special_tokens": ["<unk>", "<s>", "</s>", "<pad>"],
    },
    "model": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        # vLLM's CPU attention backend requires head_dim >= 32.
        "head_dim": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    },
}

# Minimal role-prefixed transcript template, so /v1/chat/completions works. It emits
# bos itself because vLLM does not add special tokens to rendered chat prompts.
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Tokenizer training text. Fixed and embedded so training is offline and reproducible.
_CORPUS = """\
The engine wakes before the first request arrives. It loads its weights, measures
the memory it may use, and carves the cache into blocks of equal size. Each block
holds the keys and values of a few tokens, and the scheduler hands blocks out as
sequences grow. When a sequence finishes, its blocks return to the free list, and
the next request in the queue can take them.

A control plane sits beside the engine. It does not compute anything itself; it
answers questions and relays orders. How many requests are waiting? How many are
running? How much of the cache is in use? Please stop this request, drain the
queue, and tell me when the last token has left the building. Small questions,
asked often, answered quickly: that is the whole job.

On a quiet morning the harbour was still. The fishing boats came back one by one,
their nets heavy, their engines coughing in the cold air. Gulls followed them in
long lazy circles. On the quay an old man counted crates and wrote numbers in a
notebook with a short pencil, the way his father had done, and his father before.

Water boils at one hundred degrees at sea level, but at lower temperatures on a
mountain, where the air is thin. A cup of tea brewed at the summit tastes weaker,
which surprises most climbers the first time. They blame the leaves, the kettle,
or the water, and only later learn that the sky itself was the culprit.

Good software is mostly careful plumbing. Data flows in, is checked, transformed,
and flows out again. The interesting part is rarely the clever algorithm; it is
the handling of the cases nobody expected: the empty list, the slow disk, the
message that arrives twice, the user who presses the button before the page has
finished loading. Write the boring checks first, and the clever parts later.

She opened the window and the smell of rain came in, with the sound of a bicycle
bell from the street below. The letter on the table was still unanswered. She
read it again, slowly, and this time she smiled, because she finally understood
what her brother had been trying to say for all those years.

Numbers: one, two, three, four, five, six, seven, eight, nine, ten. Eleven and
twelve come next, then thirteen, fourteen, fifteen. Counting is the oldest kind of
computing, older than writing, and every child rediscovers it with their fingers.

The river runs north through the valley, past the mill and the old stone bridge,
and into the lake where the town gets its water. In spring the snow melts and the
river rises; in late summer it shrinks to a thin silver thread between the rocks.
Farmers along its banks have learned to plant early and harvest before the frost.

Hello world! How are you today? I am fine, thank you. What would you like to do?
Let us write a program, test it, and ship it. Then we will rest, and tomorrow we
will read the logs, fix what broke, and do it all over again, a little better.
"""

_MARKER_NAME = "enginectl_recipe.json"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    _MARKER_NAME,
)


def _recipe_fingerprint() -> dict[str, Any]:
    """Everything that feeds the build, so one hash covers it all."""
    return {
        "version": RECIPE_VERSION,
        "recipe": _RECIPE,
        "chat_template": _CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(_CORPUS.encode("utf-8")).hexdigest(),
    }


def _recipe_hash() -> str:
    """Short, stable hash of the recipe; part of the folder name so edits rebuild."""
    blob = json.dumps(_recipe_fingerprint(), sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:10]


MODEL_DIR_NAME = f"tiny-llama-v{RECIPE_VERSION}-{_recipe_hash()}"


def default_cache_dir() -> Path:
    """Where enginectl caches things: $ENGINECTL_CACHE_DIR, else $XDG_CACHE_HOME/enginectl.

    XDG_CACHE_HOME is honoured only if absolute, as the XDG spec requires.
    """
    explicit = os.environ.get("ENGINECTL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "enginectl"
    return Path.home() / ".cache" / "enginectl"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the default tiny Llama, building it on first use.

    ``cache_dir`` overrides the cache root (see ``default_cache_dir``); the model
    lives at ``<cache_dir>/models/<MODEL_DIR_NAME>``.

    Safe under concurrency: builders serialise on an fcntl lock and re-check after
    acquiring it, and a model is built in a temp dir then ``os.rename``d into place,
    so callers only ever see a complete directory (or none at all). The fast path,
    when the model already exists, takes no lock and imports nothing heavy.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    models_dir = root / "models"
    target = models_dir / MODEL_DIR_NAME
    if _is_complete(target):
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{MODEL_DIR_NAME}.lock"):
        # Another process may have finished the build while we waited for the lock.
        if _is_complete(target):
            return target
        _remove_leftovers(models_dir, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=models_dir))
        try:
            _build(tmp)
            _fsync_tree(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the model is not secret.
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(models_dir)
    return target


def _is_complete(path: Path) -> bool:
    """A dir counts only if every file is there; the marker is written last anyway."""
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock; the kernel drops it if the process dies.

    The lock file is left in place on purpose: deleting it would let a waiter and a
    newcomer lock two different inodes at once.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _remove_leftovers(models_dir: Path, target: Path) -> None:
    """Clear debris from crashed builders. Only called while holding the lock.

    Temp dirs of this recipe belong to no live builder (they all need the lock),
    and an incomplete ``target`` (e.g. hand-edited) is moved aside before deletion.
    """
    for stale in models_dir.glob(f".{MODEL_DIR_NAME}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=models_dir))
        os.rename(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def _build(out: Path) -> None:
    """Write tokenizer, config, weights and marker into ``out`` (an empty dir)."""
    tokenizer = _train_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    _write_tokenizer_files(out, tokenizer)
    _write_model_files(out, vocab_size)
    marker = {**_recipe_fingerprint(), "model_dir_name": MODEL_DIR_NAME, "vocab_size": vocab_size}
    _write_json(out / _MARKER_NAME, marker)


def _train_tokenizer() -> Any:
    """Train a byte-level BPE on the embedded corpus; returns a ``tokenizers.Tokenizer``.

    Byte-level means any input text encodes without <unk>. bos is prepended by the
    post-processor, which is what Llama-style prompts expect.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = _RECIPE["tokenizer"]
    unk, bos = spec["special_tokens"][0], spec["special_tokens"][1]
    tokenizer = Tokenizer(models.BPE(unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        min_frequency=spec["min_frequency"],
        special_tokens=spec["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    return tokenizer


def _write_tokenizer_files(out: Path, tokenizer: Any) -> None:
    """Write files that make AutoTokenizer load a PreTrainedTokenizerFast.

    tokenizer_class is the generic fast class on purpose: a Llama-specific class
    would try to rebuild the tokenizer from a sentencepiece model we do not have.
    """
    unk, bos, eos, pad = _RECIPE["tokenizer"]["special_tokens"]
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": _RECIPE["model"]["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": _CHAT_TEMPLATE,
        },
    )


def _write_model_files(out: Path, vocab_size: int) -> None:
    """Save a seeded random LlamaForCausalLM (float32, safetensors) plus generation config.

    The global torch RNG is forked so building inside the server does not disturb
    any seeding done elsewhere in the process.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    spec = _RECIPE["model"]
    _, bos, eos, pad = _RECIPE["tokenizer"]["special_tokens"]
    # The trainer gives special tokens the first ids, in recipe order.
    ids = {tok: i for i, tok in enumerate(_RECIPE["tokenizer"]["special_tokens"])}
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        dtype="float32",
        **spec,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_RECIPE["seed"])
        model = LlamaForCausalLM(config).float().eval()
    model.generation_config = GenerationConfig(bos_token_id=ids[bos], eos_token_id=ids[eos], pad_token_id=ids[pad])
    # Silence the one-shard "Writing model shards" bar in server logs; restore after.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Stable JSON (sorted keys, trailing newline) so rebuilds are byte-identical."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fsync_tree(path: Path) -> None:
    """Flush the files before the rename publishes them, so a crash cannot expose
    a complete-looking directory with empty files. Also makes them world-readable
    (safetensors writes 0600), as the model is shared, not secret."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            os.chmod(p, 0o644)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    """Persist directory entries (new files, the rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A user's own model on vLLM's CPU build. Without a memory flag vLLM's CPU worker reserves 92%
# of the machine's RAM (--gpu-memory-utilization's default) and refuses to start when less is
# free. Instead, give the KV cache a quarter of the memory available at start, at most 4 GiB
# (what vLLM's CPU build reserved by default before it switched to a fraction of RAM), shared
# by every worker of this host. Weights and activations keep the other three quarters.
KV_CACHE_SHARE = 4
KV_CACHE_CAP_BYTES = 4 * 1024**3
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU-only setting, in GiB
KV_CACHE_FLAG = "--kv-cache-memory-bytes"


@dataclass(frozen=True)
class KvCacheDefault:
    """The KV-cache size chosen for a start that named none: bytes per worker, and why."""

    bytes_per_worker: int
    workers: int
    available_bytes: int

    def describe(self) -> dict[str, Any]:
        """The fields of the one log line that announces it (server/serve.py)."""
        return {
            "kv_cache_memory_bytes": self.bytes_per_worker,
            "workers": self.workers,
            "available_memory_bytes": self.available_bytes,
            "rule": f"1/{KV_CACHE_SHARE} of available memory, at most {KV_CACHE_CAP_BYTES // 1024**3} GiB in all",
            "override": f"{KV_CACHE_FLAG} BYTES (per worker) or --gpu-memory-utilization FRACTION",
        }


def cpu_kv_cache_bytes(available: int, workers: int = 1) -> int:
    """KV-cache bytes per worker when `workers` workers share a host with `available` bytes free."""
    return min(available // KV_CACHE_SHARE, KV_CACHE_CAP_BYTES) // max(workers, 1)


def memory_flags_unset() -> argparse.Namespace:
    """The namespace to parse `enginectl serve`'s flags into: --gpu-memory-utilization starts
    as None, so after parsing None means the user did not pass it (its default is a number,
    which a user may also pass). `cpu_kv_cache_default` puts the default back."""
    return argparse.Namespace(gpu_memory_utilization=None)


def cpu_kv_cache_default(args: argparse.Namespace, default_utilization: float) -> KvCacheDefault | None:
    """Runs in the `enginectl serve` process, on flags parsed into `memory_flags_unset()`.

    Restores --gpu-memory-utilization's default if the user left it out; then, on vLLM's CPU
    build, when the user named no KV-cache memory at all (neither --kv-cache-memory-bytes, nor
    --gpu-memory-utilization, nor $VLLM_CPU_KVCACHE_SPACE), sets `args.kv_cache_memory_bytes`
    to `cpu_kv_cache_bytes` of the memory available now and returns what it chose (None when
    it chose nothing).
    """
    utilization_passed = args.gpu_memory_utilization is not None
    if not utilization_passed:
        args.gpu_memory_utilization = default_utilization
    if utilization_passed or args.kv_cache_memory_bytes is not None or os.environ.get(KV_CACHE_ENV, ""):
        return None
    import psutil
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    available = int(psutil.virtual_memory().available)
    dp_local = getattr(args, "data_parallel_size_local", None) or args.data_parallel_size
    workers = int(dp_local) * int(args.tensor_parallel_size) * int(args.pipeline_parallel_size)
    chosen = KvCacheDefault(cpu_kv_cache_bytes(available, workers), workers, available)
    args.kv_cache_memory_bytes = chosen.bytes_per_worker
    return chosen


if __name__ == "__main__":
    print(ensure_default_model())
