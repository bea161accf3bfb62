"""Recovery you can trust: after a partial update, and generation forced to run over the mixed
weights, a successful update serves exactly what a fresh engine serves for the same checkpoint
(docs/weights.md, "Recovery after a partial update").

The failure this guards against, reproduced here without any fake: weights that compute NaN
(a trainer that diverged, or the uninitialised remains of a layer a broken load wrote part
of) make generation write NaN into KV-cache blocks; a prefix-cache reset frees those blocks
without clearing them, and vLLM's CPU attention reads whole blocks, so the first requests
after a *successful* update read NaN from slots past their own end and emit token 0 under a
declared version. Now every load is checked (a layer that computes NaN or infinity fails the
update, named), and an update after a partial one zeroes the KV cache.

The reference is the session's `server` (tests/e2e/conftest.py): an engine serving checkpoint
A whose weights no test changes, its greedy tokens and its full digest. On the session's
`weights_server`; each test leaves it on A, resumed (`back_to_a`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, assert_serves, greedy_tokens, serving_now

from e2e.own_servers import trainer_client
from enginectl.client import TrainerClient
from enginectl.client.errors import EnginectlError
from enginectl.weights.v1 import weight_update_service_pb2 as upb

# Prompts of several lengths, one past a 128-token KV block (the CPU block size).
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [5, 5, 5, 5, 5, 5], list(range(3, 203))]
POISONED = "model.layers.0.self_attn.o_proj.weight"

client = trainer_client()


@pytest.fixture(scope="module")
def reference(server: ServeProcess) -> tuple[list[list[int]], str]:
    """Checkpoint A as a fresh engine serves it: greedy tokens per prompt, the full digest."""
    return serving_now(server, PROMPTS)


@pytest.fixture(scope="module")
def states(checkpoints: Checkpoints) -> dict[str, dict[str, Any]]:
    return {which: checkpoints.state_dict(which) for which in ("A", "B")}


def poisoned(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with one layer's weight all NaN, as a diverged trainer sends it."""
    import torch

    return {**state, POISONED: torch.full_like(state[POISONED], float("nan"))}


def generate_over_mixed_weights(weights_server: ServeProcess, stubs: Stubs) -> None:
    """The quarantine's way out for rollouts: a forced resume, then generation (which writes
    what these weights compute into the KV cache)."""
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=30)
    for prompt in PROMPTS:
        greedy_tokens(weights_server, prompt)


def test_weights_that_compute_nan_are_not_served(
    weights_server: ServeProcess,
    stubs: Stubs,
    client: TrainerClient,
    states: dict[str, dict[str, Any]],
    reference: tuple[list[list[int]], str],
) -> None:
    with pytest.raises(EnginectlError) as failed:
        client.update_weights_from_tensors(poisoned(states["A"]), "nan", timeout=60)
    err = failed.value
    assert (err.reason, err.metadata["cause"], err.metadata["tensor"]) == (
        "PARTIAL_UPDATE",
        "WEIGHTS_NOT_FINITE",
        POISONED.rsplit(".", 1)[0],  # the packed layer it feeds computes NaN
    ), err
    version = client.get_weight_version()
    assert not version.declared and version.last_failure is not None
    assert (
        version.last_failure.cause == "WEIGHTS_NOT_FINITE"
        and POISONED.rsplit(".", 1)[0] in version.last_failure.message
    )
    assert stubs.state().paused  # held: never resumed over them
    client.update_weights_from_tensors(states["A"], "A-after-nan", timeout=60)
    assert_serves(weights_server, reference, PROMPTS)


def _tensors(client: TrainerClient, state: dict[str, Any], checkpoints: Checkpoints) -> Any:
    return client.update_weights_from_tensors(state, "recovered", timeout=60)


def _disk(client: TrainerClient, state: dict[str, Any], checkpoints: Checkpoints) -> Any:
    return client.update_weights_from_disk(str(checkpoints.a), "recovered", timeout=60)


def _ipc(client: TrainerClient, state: dict[str, Any], checkpoints: Checkpoints) -> Any:
    return client.update_weights_from_ipc(state, "recovered", timeout=60)


def _broadcast(client: TrainerClient, state: dict[str, Any], checkpoints: Checkpoints) -> Any:
    client.init_weights_update_group("recovery", timeout=60)
    try:
        return client.broadcast_weights(state, "recovered", group_name="recovery", timeout=60)
    finally:
        client.destroy_weights_update_group("recovery", allow_missing=True)


def _staged(client: TrainerClient, state: dict[str, Any], checkpoints: Checkpoints) -> Any:
    staged = client.stage_weights_from_tensors(state, "recovered", timeout=60)
    return client.commit_staged_weights(staged.name)


RECOVERIES: dict[str, Callable[[TrainerClient, dict[str, Any], Checkpoints], Any]] = {
    "tensor-stream": _tensors,
    "disk": _disk,
    "ipc": _ipc,
    "broadcast": _broadcast,
    "staged-commit": _staged,
}


@pytest.mark.parametrize("source", list(RECOVERIES))
def test_a_recovery_after_generation_over_nan_weights_serves_what_a_fresh_engine_serves(
    source: str,
    weights_server: ServeProcess,
    stubs: Stubs,
    client: TrainerClient,
    checkpoints: Checkpoints,
    states: dict[str, dict[str, Any]],
    reference: tuple[list[list[int]], str],
) -> None:
    """Poisoned weights (refused as a partial update), rollouts forced over them, then a full
    update of A through `source`: every prompt's tokens and the full digest are the fresh
    engine's. Without the KV cache cleared, the first prompts answered token 0 here."""
    with pytest.raises(EnginectlError):
        client.update_weights_from_tensors(poisoned(states["A"]), "nan", timeout=60)
    generate_over_mixed_weights(weights_server, stubs)
    result = RECOVERIES[source](client, states["A"], checkpoints)
    assert result.prefix_cache_reset or source == "staged-commit"
    version = client.get_weight_version()
    assert (version.declared, version.version, version.last_failure) == (True, "recovered", None)
    assert_serves(weights_server, reference, PROMPTS)
