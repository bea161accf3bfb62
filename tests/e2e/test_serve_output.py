"""What `enginectl serve` tells its operator: a quiet, honest start and stop.

Two real servers (tests/support/serving.py), each started, used and stopped with SIGTERM here:
- the embedded model: served as `enginectl-tiny` on vLLM's OpenAI-compatible API; its whole
  output, start to exit, has one enginectl line per lifecycle event, no error and no native
  leak report (triton is kept out of the CPU install: scripts/install.sh);
- a user's own model with no memory flag, on vLLM's CPU build: it starts, with a KV-cache
  size that fits the machine, announced in one line naming the flag that overrides it.

The rule that picks that size, and which flags opt out of it, are checked on the flag parser
itself (server/flags.py, server/default_model.py), without an engine, in
tests/unit/test_serve_output.py.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.serving import ServeProcess

from enginectl.server.default_model import (
    KV_CACHE_CAP_BYTES,
    SERVED_MODEL_NAME,
    cpu_kv_cache_bytes,
    ensure_default_model,
)

# enginectl's own lifecycle lines, in the order a clean start and stop logs them.
LIFECYCLE = ["starting engine", "engine ready", "serving", "shutting down", "stopped"]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def _complete(srv: ServeProcess, model: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{srv.http_url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        out: dict[str, Any] = json.load(response)
    return out


def _stop(srv: ServeProcess) -> list[str]:
    """SIGTERM, wait for the exit and the last of its output; every line it wrote."""
    assert srv.terminate() == 0, srv.tail()
    assert srv.exited.is_set()
    return list(srv.lines)


@pytest.fixture(scope="module")
def model_dir(serve_env: dict[str, str]) -> Path:
    """The embedded model's directory, in the session's cache (the servers build it there)."""
    return ensure_default_model(Path(serve_env["ENGINECTL_CACHE_DIR"]))


def test_embedded_model_serves_as_enginectl_tiny_and_its_whole_log_is_clean(serve_env: dict[str, str]) -> None:
    srv = ServeProcess([], serve_env).start()
    try:
        srv.wait_ready()
        assert srv.serving["served_model_name"] == SERVED_MODEL_NAME
        models = _get(f"{srv.http_url}/v1/models")["data"]
        assert [m["id"] for m in models] == [SERVED_MODEL_NAME]
        assert models[0]["root"] == srv.model  # the cache path is where it lives, not its name
        out = _complete(srv, SERVED_MODEL_NAME)
        assert out["model"] == SERVED_MODEL_NAME
        assert out["usage"]["completion_tokens"] == 4
        lines = _stop(srv)
    finally:
        srv.kill()
    leaked = [line for line in lines if "leaked" in line.lower() or "nanobind" in line.lower()]
    assert not leaked, "\n".join(leaked[:20])
    # A clean stop reports no error: no traceback from vLLM's output handler, no error event.
    errors = [line for line in lines if "Traceback" in line or " ERROR " in line or '"level": "error"' in line]
    assert not errors, "\n".join(errors[:20])
    events = [e["event"] for e in srv.events() if e.get("event") in LIFECYCLE]
    assert events == LIFECYCLE
    assert not [e for e in srv.events() if e.get("event") == "kv cache default"]  # the embedded flags set it


def test_users_model_without_memory_flags_starts_with_a_kv_cache_that_fits(
    serve_env: dict[str, str], model_dir: Path
) -> None:
    # --enforce-eager only spares the test a torch.compile; no memory flag is passed.
    srv = ServeProcess(["--model", str(model_dir), "--enforce-eager"], serve_env).start()
    try:
        srv.wait_ready()
        chosen = srv.wait_for_event(lambda e: e.get("event") == "kv cache default", timeout=5)
        assert 0 < chosen["kv_cache_memory_bytes"] <= KV_CACHE_CAP_BYTES
        assert chosen["kv_cache_memory_bytes"] == cpu_kv_cache_bytes(chosen["available_memory_bytes"])
        assert "--kv-cache-memory-bytes" in chosen["override"]
        # vLLM took it as an explicit size (not its 92%-of-RAM reservation).
        assert any("Explicitly set" in line and "KV cache" in line for line in srv.lines)
        # A user's model keeps its own name: the short name is the embedded model's.
        assert [m["id"] for m in _get(f"{srv.http_url}/v1/models")["data"]] == [str(model_dir)]
        assert _complete(srv, str(model_dir))["usage"]["completion_tokens"] == 4
        lines = _stop(srv)
    finally:
        srv.kill()
    assert not [line for line in lines if "leaked" in line.lower()]
