"""Fast tests for the default tiny model builder (no vLLM engine is started).

They check what ``enginectl serve`` relies on: the directory is complete and loadable,
sizes agree between tokenizer and model, the cache is reused, and builds are byte-for-byte
reproducible. That concurrent builders cooperate is in tests/e2e/test_default_model.py (it
spawns processes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from enginectl.server.default_model import (
    MODEL_DIR_NAME,
    default_cache_dir,
    ensure_default_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build shared by the read-only tests; building is the slow part."""
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in [directory, *sorted(directory.iterdir())]}


def test_layout_and_location(model_dir: Path) -> None:
    assert model_dir.name == MODEL_DIR_NAME
    assert model_dir.parent.name == "models"
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    total = sum(p.stat().st_size for p in model_dir.iterdir())
    assert total < 5 * 1024 * 1024


def test_config_matches_tokenizer(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.vocab_size == len(tokenizer) == 512
    head_dim = config.hidden_size // config.num_attention_heads
    assert head_dim == config.head_dim >= 32  # vLLM CPU attention needs >= 32
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.max_position_embeddings >= 256
    assert config.tie_word_embeddings is False
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id


def test_weights_shapes(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        embed = f.get_slice("model.embed_tokens.weight").get_shape()
        head = f.get_slice("lm_head.weight").get_shape()
        dtype = f.get_slice("lm_head.weight").get_dtype()
    assert embed == head == [config["vocab_size"], config["hidden_size"]]
    assert dtype == "F32"


def test_tokenizer_round_trip_and_chat(model_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "Hello world! Ünïcödé and emoji 🚀 survive byte-level BPE."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s>user: Hi\nassistant: "


def test_second_call_reuses_cache(tmp_path: Path) -> None:
    first = ensure_default_model(tmp_path)
    before = _mtimes(first)
    inode = first.stat().st_ino
    second = ensure_default_model(tmp_path)
    assert second == first
    assert second.stat().st_ino == inode
    assert _mtimes(second) == before
    # Only the model and its lock file; no temp dirs left behind.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(
        [MODEL_DIR_NAME, f".{MODEL_DIR_NAME}.lock"]
    )


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    other = ensure_default_model(tmp_path)
    assert other != model_dir
    assert _digests(other) == _digests(model_dir)


def test_replaces_debris_from_crashed_build(tmp_path: Path, model_dir: Path) -> None:
    models = tmp_path / "models"
    (models / f".{MODEL_DIR_NAME}.tmp-crashed").mkdir(parents=True)
    partial = models / MODEL_DIR_NAME
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # half-built: must not be returned as is
    path = ensure_default_model(tmp_path)
    assert path == partial
    assert _digests(path) == _digests(model_dir)
    assert not list(models.glob(f".{MODEL_DIR_NAME}.tmp-*"))


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The environment is this function's real input: monkeypatch only sets the variables for
    # this test and restores them after (nothing is faked).
    monkeypatch.delenv("ENGINECTL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "enginectl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "enginectl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "enginectl"
    monkeypatch.setenv("ENGINECTL_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    # With no argument, ensure_default_model honours the environment.
    assert ensure_default_model().parent == tmp_path / "explicit" / "models"
