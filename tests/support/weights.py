"""Checkpoints and weight-service stubs for the tests that load weights into a real server.

- `Checkpoints`: A is a copy of the embedded default model (the weights every server starts
  with), B the same files with every tensor perturbed (seeded), both under one root the
  server is allowed to read (`--allow-weights-from`); `build_checkpoints` makes them. Helpers
  give their state dicts, and `greedy_tokens` reads the greedy token ids a server generates now.
- `start_weights_server`: `enginectl serve --allow-weights-from <root> --enable-scale-out` with
  `VLLM_SERVER_DEV_MODE=1` (vLLM's `/collective_rpc`, `/pause`, `/resume` routes, used to
  bypass enginectl on purpose); `stop_server` terminates one and checks no child is left.
- `WeightStubs`: blocking stubs of a server's weight services and Operations on one channel,
  which the test modules extend.

The fixtures built on these (`checkpoints`, `weights_server`, session-wide) are in
tests/e2e/conftest.py. Runs in the pytest process.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.longrunning import operations_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from enginectl.weights.v1 import weight_version_service_pb2_grpc as vpb_grpc
from support.serving import ServeProcess, alive

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
B_SEED = 1
B_NOISE = 0.5


@dataclass(frozen=True)
class Checkpoints:
    """Paths of checkpoints A (initial weights) and B (perturbed) under an allowed `root`."""

    root: Path
    a: Path
    b: Path

    def file(self, which: str) -> Path:
        """The `.safetensors` file of checkpoint "A" or "B"."""
        return {"A": self.a, "B": self.b}[which] / "model.safetensors"

    def state_dict(self, which: str) -> dict[str, Any]:
        """Checkpoint names -> torch tensors (float32, CPU) of "A" or "B"."""
        from safetensors.torch import load_file

        return dict(load_file(str(self.file(which))))


class WeightStubs:
    """Blocking stubs of a server's WeightUpdateService, WeightVersionService and Operations."""

    timeout: float | None = None  # deadline of version() and state(), seconds (None: none)

    def __init__(self, server: ServeProcess) -> None:
        self.channel = grpc.insecure_channel(server.grpc_target)
        self.updates = upb_grpc.WeightUpdateServiceStub(self.channel)
        self.versions = vpb_grpc.WeightVersionServiceStub(self.channel)
        self.ops = operations_pb2_grpc.OperationsStub(self.channel)

    def version(self) -> wv.WeightVersion:
        return self.versions.GetWeightVersion(vpb.GetWeightVersionRequest(), timeout=self.timeout).weight_version

    def state(self) -> upb.GenerationState:
        return self.updates.GetGenerationState(upb.GetGenerationStateRequest(), timeout=self.timeout).state


def greedy_tokens(
    server: ServeProcess, prompt: list[int] | None = None, max_tokens: int = 8, timeout: float = 120.0
) -> list[int]:
    """Token ids the server generates now for `prompt` (token ids) at temperature 0."""
    body = {
        "model": server.served_model,
        "prompt": prompt or PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return list(json.load(response)["choices"][0]["token_ids"])


def generate_on_rank(server: ServeProcess, rank: int, max_tokens: int = 4) -> dict[str, Any]:
    """One greedy `/inference/v1/generate` choice from data-parallel rank `rank` (vLLM's
    X-data-parallel-rank header; with --enable-scale-out it names its `weight_versions`)."""
    body = json.dumps(
        {"token_ids": [1, 43, 375, 82], "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0}}
    )
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate",
        data=body.encode(),
        headers={"content-type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response)["choices"][0])


def takeovers(server: ServeProcess, resource: str) -> float:
    """enginectl_takeovers_total{resource=...} on the server's /metrics (docs/metrics.md)."""
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "enginectl_takeovers_total" and sample.labels == {"resource": resource}:
                return float(sample.value)
    raise AssertionError("enginectl_takeovers_total is not on /metrics")


def _build_b(a: Path, b: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(a, b)
    generator = torch.Generator().manual_seed(B_SEED)
    state = load_file(str(a / "model.safetensors"))
    perturbed = {
        name: (t + B_NOISE * torch.randn(t.shape, generator=generator, dtype=t.dtype)).contiguous()
        for name, t in state.items()
    }
    save_file(perturbed, str(b / "model.safetensors"), metadata={"format": "pt"})


def build_checkpoints(serve_env: dict[str, str], root: Path) -> Checkpoints:
    """A and B under `root`, a fresh allowed root; A is built in the servers' model cache first."""
    from enginectl.server.default_model import ensure_default_model

    served = ensure_default_model(Path(serve_env["ENGINECTL_CACHE_DIR"]))
    a, b = root / "A", root / "B"
    shutil.copytree(served, a)
    _build_b(a, b)
    return Checkpoints(root=root, a=a, b=b)


def serving_now(server: ServeProcess, prompts: list[list[int]]) -> tuple[list[list[int]], str]:
    """What `server` serves now: its greedy tokens per prompt and its full digest (rank 0)."""
    from enginectl.client import TrainerClient

    with TrainerClient(server.grpc_target) as c:
        digest = c.verify_weights(full=True).ranks[0].current_digest
    return [greedy_tokens(server, p) for p in prompts], digest


def assert_serves(server: ServeProcess, reference: tuple[list[list[int]], str], prompts: list[list[int]]) -> None:
    """`server` generates `reference`'s tokens for `prompts`, and a full VerifyWeights answers
    MATCH with `reference`'s digest."""
    from enginectl.client import TrainerClient

    tokens, digest = reference
    assert [greedy_tokens(server, p) for p in prompts] == tokens
    with TrainerClient(server.grpc_target) as c:
        verification = c.verify_weights(full=True)
    assert (verification.verdict, verification.ranks[0].current_digest) == ("MATCH", digest)


def build_tied(checkpoints: Checkpoints, root: Path) -> Checkpoints:
    """A and B of `checkpoints` under `root` as a model with tied embeddings: the config says so
    and no file holds `lm_head.weight` (the LM head is the embedding, as in Qwen's small models)."""
    from safetensors.torch import load_file, save_file

    tied = Checkpoints(root=root, a=root / "A", b=root / "B")
    for source, target in ((checkpoints.a, tied.a), (checkpoints.b, tied.b)):
        shutil.copytree(source, target)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        state = load_file(str(target / "model.safetensors"))
        state.pop("lm_head.weight")
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return tied


def start_weights_server(serve_env: dict[str, str], checkpoints: Checkpoints, *extra: str) -> ServeProcess:
    """A ready server allowed to read the checkpoints' root, in vLLM dev mode with vLLM's own
    weight routes kept (--allow-vllm-dev-routes: /collective_rpc changes weights behind the
    ledger, which test_weight_update.py's drift test does on purpose), and with vLLM's weight
    transfer configured on enginectl's registered `gloo` engine (test_transfer_engine.py)."""
    env = dict(serve_env, VLLM_SERVER_DEV_MODE="1")
    return (
        ServeProcess(
            [
                "--allow-weights-from",
                str(checkpoints.root),
                "--enable-scale-out",
                "--allow-vllm-dev-routes",
                "--weight-transfer-config",
                '{"backend": "gloo"}',
                *extra,
            ],
            env,
        )
        .start()
        .wait_ready()
    )


def stop_server(srv: ServeProcess) -> None:
    """Terminate `srv` and check that none of its children outlived it."""
    children = srv.descendants()
    try:
        srv.terminate()
    finally:
        srv.kill()
    assert not alive(children), f"children left behind: {alive(children)}"
