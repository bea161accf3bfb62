"""Control calls while rollouts run: the engine never crashes and every token is right.

Four clients generate through vLLM's HTTP API (`/inference/v1/generate`, varied prompt
lengths and `max_tokens`, temperature 0) while one controller runs, back to back:
declarations, VerifyWeights (sampled and full), PauseGeneration(KEEP)/Resume and weight
updates from every source (disk, tensor stream, gloo broadcast), switching the weights
between checkpoints A and B. Every version names its checkpoint (`"A:..."`, `"B:..."`), and
every output says which versions produced which tokens (`weight_versions`), so each run of
tokens generated under one checkpoint is checked against that checkpoint's reference,
generated alone before the stress. Bounded in rounds; runs on this module's own
`weights_server` and leaves it serving A, resumed.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.serving import ServeProcess
from support.weights import Checkpoints

from e2e.own_servers import own_checkpoints, own_weights_server
from enginectl.client import TrainerClient

CLIENTS = 4
ROUNDS = 6  # two updates from each source
DECLARATIONS_PER_ROUND = 12
MAX_TOKENS = 11
DEADLINE_S = 240.0  # a guard: the rounds end long before on an idle machine
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(5, 400) for _ in range(_rng.choice([3, 9, 33, 80, 150]))] for _ in range(12)]


checkpoints = own_checkpoints()
weights_server = own_weights_server()


def generate(server: ServeProcess, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0}}).encode()
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response)["choices"][0])


@pytest.fixture(scope="module")
def client(weights_server: ServeProcess) -> Iterator[TrainerClient]:
    with TrainerClient(weights_server.grpc_target, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(
    client: TrainerClient, checkpoints: Checkpoints, weights_server: ServeProcess
) -> dict[str, list[list[int]]]:
    """Each prompt's tokens under A and under B, generated one at a time; ends on A."""
    out: dict[str, list[list[int]]] = {}
    for which in ("B", "A"):
        client.update_weights_from_disk(str(checkpoints.file(which)), f"{which}:reference")
        out[which] = [generate(weights_server, prompt, MAX_TOKENS)["token_ids"] for prompt in PROMPTS]
    assert out["A"] != out["B"]
    return out


def _update(client: TrainerClient, checkpoints: Checkpoints, source: str, which: str, version: str) -> None:
    if source == "disk":
        client.update_weights_from_disk(str(checkpoints.file(which)), version)
    elif source == "tensors":
        client.update_weights_from_tensors(checkpoints.state_dict(which), version)
    else:
        group = client.init_weights_update_group("stress", timeout=60.0)
        try:
            client.broadcast_weights(checkpoints.state_dict(which), version, group_name=group.group_name)
        finally:
            client.destroy_weights_update_group(group.group_name)


def _checked_tokens(choice: dict[str, Any], reference: dict[str, list[list[int]]], index: int) -> int:
    """Assert the tokens of the leading run of versions of one checkpoint; how many it checked."""
    segments = choice.get("weight_versions") or []
    if not segments or segments[0]["start"] != 0 or ":" not in str(segments[0]["version"]):
        return 0
    which = segments[0]["version"].split(":")[0]
    end = 0
    for segment in segments:
        if segment["version"].split(":")[0] != which or segment["start"] != end:
            break
        end = segment["end"]
    tokens = choice["token_ids"]
    assert tokens[:end] == reference[which][index][:end], (
        f"prompt {index} under {which} ({segments}): got {tokens}, expected {reference[which][index]}"
    )
    return end


def test_control_calls_during_rollouts_never_corrupt_the_engine(
    client: TrainerClient,
    checkpoints: Checkpoints,
    weights_server: ServeProcess,
    reference: dict[str, list[list[int]]],
) -> None:
    stop = threading.Event()
    outputs: list[tuple[int, dict[str, Any]]] = []
    failures: list[str] = []

    def rollouts(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            index = rng.randrange(len(PROMPTS))
            try:
                outputs.append((index, generate(weights_server, PROMPTS[index], rng.randint(1, MAX_TOKENS))))
            except Exception as exc:  # noqa: BLE001 - any failed generation fails the test
                failures.append(f"generation failed: {exc!r}")
                stop.set()

    client.set_weight_version("A:start")
    threads = [threading.Thread(target=rollouts, args=(seed,), daemon=True) for seed in range(CLIENTS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DEADLINE_S
    loaded = "A"
    verdicts: list[str] = []
    try:
        for round_ in range(ROUNDS):
            if stop.is_set() or time.monotonic() > deadline:
                break
            for i in range(DECLARATIONS_PER_ROUND):
                client.set_weight_version(f"{loaded}:r{round_}-d{i}")
            verdicts += [client.verify_weights().verdict, client.verify_weights(full=True).verdict]
            with client.paused("keep"):
                client.set_weight_version(f"{loaded}:r{round_}-paused")
            loaded = "B" if loaded == "A" else "A"
            _update(client, checkpoints, ("disk", "tensors", "distributed")[round_ % 3], loaded, f"{loaded}:r{round_}")
            verdicts.append(client.verify_weights(full=True).verdict)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
        if loaded != "A":
            client.update_weights_from_disk(str(checkpoints.file("A")), "A:end")
    assert not failures, failures[:3]
    assert verdicts and set(verdicts) == {"MATCH"}, verdicts
    checked = sum(_checked_tokens(choice, reference, index) for index, choice in outputs)
    assert len(outputs) >= 4 * ROUNDS and checked >= 20, (len(outputs), checked)
    # Still serving, and right, after the stress.
    with grpc.insecure_channel(weights_server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    client.set_weight_version("A:after")
    for index in range(len(PROMPTS)):
        assert generate(weights_server, PROMPTS[index], MAX_TOKENS)["token_ids"] == reference["A"][index]
