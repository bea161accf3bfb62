"""The rule that picks the KV-cache size `enginectl serve` starts a user's model with, and which
flags opt out of it, checked on the flag parser itself (server/flags.py,
server/default_model.py), without an engine. What a real server logs, and that it starts
with that size, is in tests/e2e/test_serve_output.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from enginectl.server.default_model import (
    KV_CACHE_CAP_BYTES,
    SERVED_MODEL_NAME,
    cpu_kv_cache_bytes,
    ensure_default_model,
)

GiB = 1024**3


@pytest.fixture(scope="module")
def model_dir(serve_env: dict[str, str]) -> Path:
    """The embedded model's directory, in the session's cache (the servers build it there)."""
    return ensure_default_model(Path(serve_env["ENGINECTL_CACHE_DIR"]))


def test_kv_cache_default_is_a_quarter_of_available_memory_capped_and_shared_by_workers() -> None:
    assert cpu_kv_cache_bytes(8 * GiB) == 2 * GiB
    assert cpu_kv_cache_bytes(64 * GiB) == KV_CACHE_CAP_BYTES == 4 * GiB
    assert cpu_kv_cache_bytes(64 * GiB, workers=2) == 2 * GiB  # the cap is for the whole host
    assert cpu_kv_cache_bytes(8 * GiB, workers=4) == GiB // 2


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch, serve_env: dict[str, str]) -> None:
    """parse_args builds or finds the embedded model in the session's cache; the environment
    is parse_args' real input (monkeypatch sets it for one test and restores it)."""
    monkeypatch.setenv("ENGINECTL_CACHE_DIR", serve_env["ENGINECTL_CACHE_DIR"])
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


@pytest.mark.usefixtures("cache_env")
def test_flags_the_memory_default_leaves_alone(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from enginectl.server.flags import parse_args

    model = ["--model", str(model_dir)]
    chosen = parse_args(model)
    assert chosen.kv_cache_default is not None
    assert chosen.kv_cache_memory_bytes == chosen.kv_cache_default.bytes_per_worker > 0
    assert chosen.gpu_memory_utilization == 0.92  # vLLM's default, put back
    assert parse_args([*model, "-dp", "2"]).kv_cache_default.workers == 2

    # Any memory flag of the user's, even one equal to vLLM's default, is theirs alone.
    for flags, bytes_, utilization in (
        (["--kv-cache-memory-bytes", "1G"], 1024**3, 0.92),
        (["--gpu-memory-utilization", "0.92"], None, 0.92),
        (["--gpu_memory_utilization=0.5"], None, 0.5),
    ):
        args = parse_args([*model, *flags])
        assert (args.kv_cache_default, args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (
            None,
            bytes_,
            utilization,
        ), flags
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert parse_args(model).kv_cache_default is None


@pytest.mark.usefixtures("cache_env")
def test_embedded_model_is_served_as_enginectl_tiny_unless_named() -> None:
    from enginectl.server.flags import parse_args

    embedded = parse_args([])
    assert embedded.served_model_name == [SERVED_MODEL_NAME]
    assert embedded.kv_cache_default is None  # DEFAULT_MODEL_FLAGS size its KV cache
    assert parse_args(["--served-model-name", "mine"]).served_model_name == ["mine"]
