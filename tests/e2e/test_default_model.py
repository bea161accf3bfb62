"""The default tiny model builder across processes (no vLLM engine is started): two builders
spawned at once into one cache cooperate, and build the same bytes as a build in this process.
The in-process checks of the builder are in tests/unit/test_default_model.py.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from enginectl.server.default_model import (
    MODEL_DIR_NAME,
    ensure_default_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build in this process, which the spawned builders must match byte for byte."""
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _build_in_child(cache: str, barrier: Any, results: Any) -> None:
    """Child process body (module level so spawn can import it)."""
    # Import the heavy libraries first so both children reach the build together.
    import torch  # noqa: F401
    import transformers  # noqa: F401

    barrier.wait()
    results.put(str(ensure_default_model(Path(cache))))


@pytest.mark.slow
def test_concurrent_builders_share_one_model(tmp_path: Path, model_dir: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = {results.get(timeout=300) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert paths == {str(tmp_path / "models" / MODEL_DIR_NAME)}
    built = Path(paths.pop())
    assert _digests(built) == _digests(model_dir)
    assert sorted(os.listdir(tmp_path / "models")) == sorted([MODEL_DIR_NAME, f".{MODEL_DIR_NAME}.lock"])
