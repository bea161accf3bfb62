"""Two-phase updates on one real engine: stage while generating, commit, discard, and every refusal
(docs/weights.md, "Two-phase updates").

On the session's `weights_server` (tests/e2e/conftest.py), which starts on checkpoint A; every
test leaves it on A, resumed (`back_to_a`). A stage is held open mid-transfer (a tensor stream
or a broadcast sent in two halves) to show what a rollout sees while weights are being staged:
it completes, with A's tokens, and nothing is paused. Tokens are greedy token ids from vLLM's
HTTP API; prefix-cache use is read from vLLM's own `vllm:prefix_cache_hits` counter.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints, greedy_tokens

from e2e.own_servers import trainer_client
from enginectl.client import NotFoundError, Reason, TrainerClient
from enginectl.client.trainer_tensors import chunks, tensor_spec
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

LONG_PROMPT = list(range(3, 3 + 200))  # fills a 128-token KV block (CPU block size): prefix-cached
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [5, 5, 5, 5, 5, 5], LONG_PROMPT]


client = trainer_client()


@pytest.fixture(scope="module")
def states(checkpoints: Checkpoints) -> dict[str, dict[str, Any]]:
    return {which: checkpoints.state_dict(which) for which in ("A", "B")}


@pytest.fixture(scope="module")
def references(weights_server: ServeProcess, tokens_a: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Every prompt's greedy tokens under A."""
    return {tuple(p): greedy_tokens(weights_server, p) for p in PROMPTS}


@pytest.fixture(autouse=True)
def nothing_staged(client: TrainerClient) -> Iterator[None]:
    yield
    staged = client.generation_state().staged
    if staged is not None:
        client.discard_staged_weights(staged.name, allow_missing=True)


def prefix_cache_hits(server: ServeProcess) -> float:
    """vLLM's prefix-cache hit counter (tokens), summed over engines."""
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    )


def rollouts_match(server: ServeProcess, references: dict[tuple[int, ...], list[int]], rounds: int = 2) -> None:
    """Four concurrent clients, every prompt `rounds` times: each completes with A's tokens."""
    jobs = [p for _ in range(rounds) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        for prompt, got in zip(jobs, pool.map(lambda p: greedy_tokens(server, p), jobs), strict=True):
            assert got == references[tuple(prompt)], prompt


def unchanged(stubs: Stubs, before: Any) -> None:
    after = stubs.version()
    assert (after.declared, after.version, after.etag, after.revision) == (
        before.declared,
        before.version,
        before.etag,
        before.revision,
    )
    assert not stubs.state().paused


# --- stage, then commit ----------------------------------------------------------------------


def test_disk_stage_changes_nothing_until_the_commit(
    weights_server: ServeProcess,
    client: TrainerClient,
    stubs: Stubs,
    checkpoints: Checkpoints,
    references: dict[tuple[int, ...], list[int]],
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    before = stubs.version()
    greedy_tokens(weights_server, LONG_PROMPT)  # in the prefix cache now
    hits = prefix_cache_hits(weights_server)

    with ThreadPoolExecutor(1) as pool:  # rollouts run while the stage does
        rolling = pool.submit(rollouts_match, weights_server, references)
        staged = client.stage_weights_from_disk(str(checkpoints.b), "B-staged")
        rolling.result()

    assert (staged.source, staged.weight_version) == ("DISK", "B-staged")
    assert staged.tensors == len(checkpoints.state_dict("B"))
    assert staged.bytes == sum(t.numel() * t.element_size() for t in checkpoints.state_dict("B").values())
    assert staged.fingerprint_method == "staged-crc32" and staged.expire_time is not None
    assert client.generation_state().staged == staged
    unchanged(stubs, before)
    assert greedy_tokens(weights_server) == tokens_a
    # The stage reset nothing: the long prompt still hits the prefix cache.
    greedy_tokens(weights_server, LONG_PROMPT)
    assert prefix_cache_hits(weights_server) >= hits + 128

    result = client.commit_staged_weights(staged.name)
    assert (result.weight_version.version, result.weight_version.source.value) == ("B-staged", "DISK")
    assert result.weight_version.revision == before.revision + 1
    assert result.prefix_cache_reset and result.generation_resumed
    assert greedy_tokens(weights_server) == tokens_b
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH
    assert client.generation_state().staged is None
    # The commit reset the cache: the long prompt misses once.
    hits = prefix_cache_hits(weights_server)
    greedy_tokens(weights_server, LONG_PROMPT)
    assert prefix_cache_hits(weights_server) == hits
    # Consumed: a second commit finds nothing.
    with pytest.raises(NotFoundError) as refused:
        client.commit_staged_weights(staged.name)
    assert refused.value.reason == Reason.STAGED_WEIGHTS_NOT_FOUND


def test_a_rollout_completes_while_a_tensor_stream_is_half_staged(
    weights_server: ServeProcess,
    stubs: Stubs,
    states: dict[str, dict[str, Any]],
    references: dict[tuple[int, ...], list[int]],
    tokens_b: list[int],
) -> None:
    before = stubs.version()
    named = list(states["B"].items())
    header = upb.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named], stage_only=True)
    header.weight_version = "B-stream"
    messages = [upb.UpdateWeightsFromTensorsRequest(header=header), *chunks(named, 64 * 1024)]
    half = len(messages) // 2
    halfway = threading.Event()
    go_on = threading.Event()

    def stream() -> Iterator[upb.UpdateWeightsFromTensorsRequest]:
        yield from messages[:half]
        halfway.set()
        assert go_on.wait(120)
        yield from messages[half:]

    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(stubs.updates.UpdateWeightsFromTensors, stream(), timeout=120)
        assert halfway.wait(120)
        # Mid-stage: generation runs, with A's weights, on every prompt and client.
        rollouts_match(weights_server, references)
        state = stubs.state()
        assert not state.paused and state.update_operation == ""
        unchanged(stubs, before)
        go_on.set()
        op = stubs.wait(call.result())

    response = upb.UpdateWeightsResponse()
    assert op.WhichOneof("result") == "response", op.error
    op.response.Unpack(response)
    metadata = upb.UpdateWeightsMetadata()
    op.metadata.Unpack(metadata)
    assert metadata.phase == upb.UPDATE_PHASE_STAGED and not metadata.weights_modified
    assert response.staged.source == wv.WEIGHT_SOURCE_TENSORS
    unchanged(stubs, before)

    commit = stubs.wait(stubs.updates.CommitStagedWeights(upb.CommitStagedWeightsRequest(name=response.staged.name)))
    assert commit.WhichOneof("result") == "response", commit.error
    assert stubs.version().version == "B-stream"
    assert greedy_tokens(weights_server) == tokens_b


def test_a_rollout_completes_while_a_broadcast_is_half_staged(
    weights_server: ServeProcess,
    client: TrainerClient,
    stubs: Stubs,
    states: dict[str, dict[str, Any]],
    references: dict[tuple[int, ...], list[int]],
    tokens_b: list[int],
) -> None:
    client.init_weights_update_group("stage-gloo", timeout=60)
    try:
        before = stubs.version()
        broadcast = client.start_broadcast(
            states["B"], "B-gloo", group_name="stage-gloo", bucket_bytes=0, stage_only=True, timeout=120
        )
        broadcast.send(len(states["B"]) // 2)
        rollouts_match(weights_server, references)  # mid-broadcast
        unchanged(stubs, before)
        broadcast.send()
        staged = broadcast.wait().staged
        assert staged is not None and staged.source == "DISTRIBUTED"
        unchanged(stubs, before)
        client.commit_staged_weights(staged.name, "B-gloo-commit")
        assert stubs.version().version == "B-gloo-commit"
        assert greedy_tokens(weights_server) == tokens_b
    finally:
        client.destroy_weights_update_group("stage-gloo", allow_missing=True)


def test_the_same_tensors_staged_twice_have_the_same_digest(
    client: TrainerClient, checkpoints: Checkpoints, states: dict[str, dict[str, Any]]
) -> None:
    from_disk = client.stage_weights_from_disk(str(checkpoints.b))
    client.discard_staged_weights(from_disk.name)
    from_stream = client.stage_weights_from_tensors(states["B"])
    client.discard_staged_weights(from_stream.name)
    other = client.stage_weights_from_tensors(states["A"])
    assert from_disk.fingerprint == from_stream.fingerprint != other.fingerprint


# --- discard and refusals --------------------------------------------------------------------


def test_discard_frees_the_set_and_changes_nothing(
    weights_server: ServeProcess,
    client: TrainerClient,
    stubs: Stubs,
    states: dict[str, dict[str, Any]],
    tokens_a: list[int],
) -> None:
    before = stubs.version()
    staged = client.stage_weights_from_tensors(states["B"], "never")
    assert client.discard_staged_weights(staged.name) == staged.bytes
    assert client.generation_state().staged is None
    unchanged(stubs, before)
    assert greedy_tokens(weights_server) == tokens_a
    with pytest.raises(NotFoundError) as refused:
        client.commit_staged_weights(staged.name)
    assert refused.value.reason == Reason.STAGED_WEIGHTS_NOT_FOUND
    with pytest.raises(NotFoundError):
        client.discard_staged_weights(staged.name)
    assert client.discard_staged_weights(staged.name, allow_missing=True) == 0


def test_refusals_answer_their_reason_and_keep_the_set(
    weights_server: ServeProcess,
    client: TrainerClient,
    stubs: Stubs,
    checkpoints: Checkpoints,
    states: dict[str, dict[str, Any]],
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    def refused(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=60)
        return err.value.code(), error_info(err.value).reason

    # Bigger than --max-staged-bytes (default: the model's size): the same tensors as float64.
    import torch

    doubled = {name: t.to(torch.float64) for name, t in states["A"].items()}
    header = upb.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in doubled.items()], stage_only=True)
    assert refused(
        stubs.updates.UpdateWeightsFromTensors, iter([upb.UpdateWeightsFromTensorsRequest(header=header)])
    ) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.STAGING_LIMIT_EXCEEDED)
    assert client.generation_state().staged is None

    staged = client.stage_weights_from_disk(str(checkpoints.b), "B-kept")
    before = stubs.version()
    # A second stage while one is kept.
    second = upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.a), stage_only=True)
    assert refused(stubs.updates.UpdateWeightsFromDisk, second) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.STAGED_WEIGHTS_EXIST,
    )
    # Unknown, malformed, and a stale etag.
    unknown = upb.CommitStagedWeightsRequest(name="staged/0123456789abcdef")
    assert refused(stubs.updates.CommitStagedWeights, unknown) == (
        grpc.StatusCode.NOT_FOUND,
        Reason.STAGED_WEIGHTS_NOT_FOUND,
    )
    for bad in ("", "operations/x", "staged/../x", "staged/" + "a" * 300):
        assert refused(stubs.updates.CommitStagedWeights, upb.CommitStagedWeightsRequest(name=bad)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.STAGED_NAME_INVALID,
        )
    stale = upb.CommitStagedWeightsRequest(name=staged.name, etag="not-the-etag")
    assert refused(stubs.updates.CommitStagedWeights, stale) == (grpc.StatusCode.ABORTED, Reason.ETAG_MISMATCH)
    # A regular update meanwhile is fine, and leaves the set alone.
    client.update_weights_from_disk(str(checkpoints.a), "A-again")

    # Nothing of the above changed the set, the tokens or anything but that last update.
    assert client.generation_state().staged == staged
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.version().revision == before.revision + 1
    # The fenced commit applies with the etag read now.
    etag = stubs.version().etag
    result = client.commit_staged_weights(staged.name, etag=etag)
    assert result.weight_version.version == "B-kept"
    assert greedy_tokens(weights_server) == tokens_b


def test_server_info_offers_staging(client: TrainerClient, states: dict[str, dict[str, Any]]) -> None:
    info = client.get_server_info()
    assert info.max_staged_bytes == sum(t.numel() * t.element_size() for t in states["A"].values())
    assert info.staged_ttl == 600.0
    assert "enginectl.weights.v1.WeightUpdateService/CommitStagedWeights" in info.supported_rpcs
    assert "enginectl.weights.v1.WeightUpdateService/DiscardStagedWeights" in info.supported_rpcs


# --- which version produced which tokens ---------------------------------------------------


def generate(server: ServeProcess, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """vLLM's /inference/v1/generate (its RequestOutput, with `weight_versions`)."""
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response)["choices"][0])


def test_a_request_held_across_a_keep_commit_names_both_versions(
    weights_server: ServeProcess, client: TrainerClient, stubs: Stubs, checkpoints: Checkpoints
) -> None:
    staged = client.stage_weights_from_disk(str(checkpoints.b), "after-commit")
    old = stubs.version().version
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(generate, weights_server, [1, 2, 3, 4], 480)
        deadline = time.monotonic() + 60
        while stubs.state().num_running_requests < 1:  # the request is being generated
            assert time.monotonic() < deadline, "the long request never started"
        held = client.pause_generation("keep")  # freeze it mid-way, then commit under the pause
        assert held.state.num_running_requests == 1, "the request ended before it could be held"
        client.commit_staged_weights(staged.name)
        client.resume_generation()
        choice = long.result()
    spans = choice["weight_versions"]
    n = len(choice["token_ids"])
    assert [s["version"] for s in spans] == [old, "after-commit"], spans
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == n, spans
    after = generate(weights_server, [1, 2, 3, 4], 8)
    assert after["weight_versions"] == [{"version": "after-commit", "start": 0, "end": len(after["token_ids"])}]
