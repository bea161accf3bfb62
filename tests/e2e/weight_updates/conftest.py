"""Fixtures of the weight-update modules in this folder, on the session's `weights_server`.

- `tokens_a` (module): loads checkpoint A (declared "A") and reads its greedy tokens.
- `tokens_b` (module): B's greedy tokens (different from A's), back on A afterwards.
- `back_to_a` (autouse): after each test, generation resumed (forced) and A loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens

from enginectl.weights.v1 import weight_update_service_pb2 as upb


@pytest.fixture(scope="module")
def tokens_a(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> list[int]:
    stubs.load(checkpoints.a, "A")
    return greedy_tokens(weights_server)


@pytest.fixture(scope="module")
def tokens_b(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]) -> list[int]:
    stubs.load(checkpoints.b, "B")
    tokens = greedy_tokens(weights_server)
    stubs.load(checkpoints.a, "A")
    assert tokens != tokens_a, "checkpoint B must generate differently from A"
    return tokens


@pytest.fixture(autouse=True)
def back_to_a(stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]) -> Iterator[None]:
    yield
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True))
    stubs.load(checkpoints.a, "A")
