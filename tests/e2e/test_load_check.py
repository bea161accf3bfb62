"""The check after every load: weights that compute other than what was written into them
are never served under a version (docs/weights.md, "The check after every load").

Finite is not enough: a load that writes part of a fused layer leaves the rest as vLLM's
layerwise reload materialised it (`torch.empty` memory, finite garbage as often as NaN), and a
kernel built from other bytes than the load received computes wrong with finite numbers. The
worker records what each load wrote into each layer and, before generation resumes, runs every
linear kernel on a probe against the output of the written weight (worker/weights/written.py).

The module's model has tied embeddings (the LM head is the embedding, as in Qwen's small
models): the session's checkpoints A and B with `lm_head.weight` dropped (tests/support/weights.py
`build_tied`). Its reference is a fresh engine serving tied B: its greedy tokens and full digest.

- Real, no fake: an update of B into an engine started on A. vLLM 0.32's reload writes the
  embedding and leaves the LM head's kernel packed from A (the check names it; without the
  check, these tokens differed from the reference's); enginectl rebuilds that kernel, and the
  update serves exactly the reference.
- Real, no fake: an update of q_proj alone writes a third of layer 0's fused qkv_proj; it fails
  as PARTIAL_UPDATE, cause WEIGHTS_MISMATCH, naming the layer.
- A FAKE worker extension (tests/support/corrupting_worker.py says why) rebuilds one layer's
  kernel from other bytes after a load: the update fails the same way, naming that layer, and
  VerifyWeights never answers MATCH over it.
- After each failure, a full update of B serves exactly the reference again.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import (
    Checkpoints,
    assert_serves,
    build_tied,
    greedy_tokens,
    serving_now,
    start_weights_server,
    stop_server,
)

from e2e.own_servers import trainer_client
from enginectl.client import TrainerClient
from enginectl.client.errors import EnginectlError

TESTS = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], list(range(3, 203))]
CORRUPTED = "model.layers.1.mlp.down_proj"

client = trainer_client()


@pytest.fixture(scope="module")
def tied(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build_tied(checkpoints, tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def reference(serve_env: dict[str, str], tied: Checkpoints) -> tuple[list[list[int]], str]:
    """Tied B as a fresh engine serves it: greedy tokens per prompt, the full digest."""
    srv = ServeProcess(["--model", str(tied.b)], serve_env).start().wait_ready()
    try:
        return serving_now(srv, PROMPTS)
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def weights_server(serve_env: dict[str, str], tied: Checkpoints) -> Iterator[ServeProcess]:
    """Tied A, on workers running the FAKE extension (unarmed, it is enginectl's own)."""
    env = dict(serve_env, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), serve_env.get("PYTHONPATH")])))
    srv = start_weights_server(
        env,
        tied,
        "--model",
        str(tied.a),
        "--worker-extension-cls",
        "support.corrupting_worker.CorruptingWorkerExtension",
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def states(tied: Checkpoints) -> dict[str, dict[str, Any]]:
    return {which: tied.state_dict(which) for which in ("A", "B")}


def arm(server: ServeProcess, layer: str) -> None:
    """Through vLLM's own /collective_rpc: every worker corrupts `layer` after its next load."""
    body = json.dumps({"method": "enginectl_test_corrupt_after_next_load", "kwargs": {"layer": layer}}).encode()
    request = urllib.request.Request(
        f"{server.http_url}/collective_rpc", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_an_update_of_a_tied_embedding_serves_what_a_fresh_engine_serves(
    weights_server: ServeProcess,
    client: TrainerClient,
    states: dict[str, dict[str, Any]],
    reference: tuple[list[list[int]], str],
) -> None:
    assert [greedy_tokens(weights_server, p) for p in PROMPTS] != reference[0]  # A is not B
    client.update_weights_from_tensors(states["B"], "B", timeout=60)
    assert client.get_weight_version().version == "B"
    assert_serves(weights_server, reference, PROMPTS)
    rebuilt = [e for e in weights_server.events() if e.get("event") == "kernels rebuilt from tied weights"]
    assert rebuilt and rebuilt[-1]["layers"] == ["lm_head"], rebuilt


def _q_proj_alone(server: ServeProcess, client: TrainerClient, states: dict[str, dict[str, Any]]) -> None:
    """Real, no fake: a third of layer 0's fused qkv_proj written; the rest never is."""
    name = "model.layers.0.self_attn.q_proj.weight"
    client.update_weights_from_tensors({name: states["A"][name]}, "q-only", timeout=60)


def _kernel_from_other_bytes(server: ServeProcess, client: TrainerClient, states: dict[str, dict[str, Any]]) -> None:
    """The FAKE: one layer's kernel rebuilt from other bytes after the load."""
    arm(server, CORRUPTED)
    client.update_weights_from_tensors(states["B"], "corrupted", timeout=60)


@pytest.mark.parametrize(
    ("fault", "layer"),
    [(_q_proj_alone, "model.layers.0.self_attn.qkv_proj"), (_kernel_from_other_bytes, CORRUPTED)],
    ids=["q-proj-alone", "fake-kernel"],
)
def test_a_layer_that_does_not_compute_with_what_was_written_fails_the_update_named(
    fault: Any,
    layer: str,
    weights_server: ServeProcess,
    stubs: Stubs,
    client: TrainerClient,
    states: dict[str, dict[str, Any]],
    reference: tuple[list[list[int]], str],
) -> None:
    with pytest.raises(EnginectlError) as failed:
        fault(weights_server, client, states)
    err = failed.value
    assert (err.reason, err.metadata["cause"], err.metadata["layer"]) == (
        "PARTIAL_UPDATE",
        "WEIGHTS_MISMATCH",
        layer,
    ), err
    version = client.get_weight_version()
    assert not version.declared and version.last_failure is not None
    assert version.last_failure.cause == "WEIGHTS_MISMATCH" and layer in version.last_failure.message
    assert client.verify_weights(full=True).verdict != "MATCH"
    assert stubs.state().paused  # held: never resumed over them
    client.update_weights_from_tensors(states["B"], "B-recovered", timeout=60)
    assert_serves(weights_server, reference, PROMPTS)


def test_a_layer_the_next_load_does_not_write_is_checked_against_what_was_written(
    weights_server: ServeProcess,
    client: TrainerClient,
    states: dict[str, dict[str, Any]],
    tied: Checkpoints,
) -> None:
    """Records outlive a load: a disk update of A, then one tensor of B, passes; every layer
    the second load did not write is checked against what the first wrote."""
    client.update_weights_from_disk(str(tied.a), "A", timeout=60)
    name = "model.layers.1.mlp.down_proj.weight"
    client.update_weights_from_tensors({name: states["B"][name]}, "A-with-B-down", timeout=60)
    assert client.get_weight_version().version == "A-with-B-down"
    assert client.verify_weights(full=True).verdict == "MATCH"
