"""Rollouts over gRPC on the control port (server/rollouts.py, docs/rollouts.md): vLLM's own
`vllm.grpc.engine.VllmEngine` service on the session's `weights_server`, driven with the
Python stubs of `smg-grpc-proto` and the real grpcurl; every Generate ends with trailers
naming the weight versions its tokens came from.

Tokens are compared with the greedy token ids of vLLM's HTTP API for the same prompt. Every
test leaves the server serving checkpoint A, declared "A", resumed (fixture `back_to_a`).
The token-guarded case is in test_serve_blackbox.py (that server has a token).
"""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import vllm_engine_pb2 as vpb2
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb2_grpc
from support.serving import BIN, ServeProcess
from support.weight_updates import Stubs
from support.weights import PROMPT, Checkpoints, greedy_tokens

from enginectl.client import GenerationVersions, generation_versions
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

SERVICE = "vllm.grpc.engine.VllmEngine"
# Long enough that a caller's PauseGeneration lands while the request still generates.
HELD_TOKENS = 200


@pytest.fixture(scope="module")
def engine(weights_server: ServeProcess) -> Iterator[vpb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(weights_server.grpc_target) as channel:
        yield vpb2_grpc.VllmEngineStub(channel)


def request(max_tokens: int = 8, stream: bool = False, **sampling: Any) -> vpb2.GenerateRequest:
    return vpb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tokenized=vpb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
        stream=stream,
    )


def generate(engine: vpb2_grpc.VllmEngineStub, req: vpb2.GenerateRequest) -> tuple[list[int], GenerationVersions]:
    """Token ids of a finished Generate (streamed or not) and the versions its trailers name."""
    call = engine.Generate(req, timeout=120)
    tokens: list[int] = []
    for response in call:
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        elif not req.stream:
            tokens.extend(response.complete.output_ids)
    return tokens, generation_versions(call.trailing_metadata())


def test_generate_matches_http_tokens_and_names_the_declared_version(
    weights_server: ServeProcess, engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, tokens_a: list[int]
) -> None:
    revision = stubs.version().revision
    for stream in (False, True):
        tokens, versions = generate(engine, request(stream=stream))
        assert tokens == tokens_a == greedy_tokens(weights_server)
        assert versions == GenerationVersions(declared=True, partial=False, versions=["A"], revision=revision)

    declared = stubs.versions.SetWeightVersion(vpb.SetWeightVersionRequest(version="step 1, ü%")).weight_version
    _, versions = generate(engine, request())
    assert (versions.version, versions.revision) == ("step 1, ü%", declared.revision)


def test_after_an_update_new_generations_name_the_new_version(
    engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    response = stubs.load(checkpoints.b, "B-new")
    tokens, versions = generate(engine, request(stream=True))
    assert tokens == tokens_b
    assert (versions.versions, versions.revision) == (["B-new"], response.weight_version.revision)


def test_undeclared_weights_say_so_instead_of_a_placeholder(
    engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    stubs.load(checkpoints.b)  # no version: the new weights are undeclared
    tokens, versions = generate(engine, request())
    assert tokens == tokens_b
    assert versions == GenerationVersions(declared=False, partial=False, versions=[], revision=None)


class HeldGeneration:
    """A streaming Generate read on its own thread; `first` is set at its first tokens."""

    def __init__(self, engine: vpb2_grpc.VllmEngineStub) -> None:
        self.call = engine.Generate(request(HELD_TOKENS, stream=True, ignore_eos=True), timeout=120)
        self.first = threading.Event()
        self.tokens: list[int] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.tokens.extend(response.chunk.token_ids)
                self.first.set()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:  # cancelled: by the test itself
                raise

    def join(self) -> list[int]:
        self._thread.join(120)
        assert not self._thread.is_alive()
        return self.tokens

    def finish(self) -> tuple[list[int], GenerationVersions]:
        return self.join(), generation_versions(self.call.trailing_metadata())


def hold_across_update(engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, update: Any) -> tuple[int, GenerationVersions]:
    """Start a long generation, pause (KEEP) once it produced tokens, run `update`, resume:
    returns how many tokens it produced in all and the versions its trailers name."""
    held = HeldGeneration(engine)
    assert held.first.wait(60), "no tokens from the held generation"
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    produced = len(held.tokens)
    assert produced < HELD_TOKENS, "the generation finished before the pause: make it longer"
    update()
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    tokens, versions = held.finish()
    return len(tokens), versions


def test_a_generation_held_across_a_keep_update_names_both_versions(
    engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]
) -> None:
    produced, versions = hold_across_update(engine, stubs, lambda: stubs.load(checkpoints.b, "B-held"))
    assert produced == HELD_TOKENS
    assert versions.versions == ["A", "B-held"] and versions.declared
    assert versions.revision == stubs.version().revision

    _, after = generate(engine, request())  # generated entirely after it: the new version only
    assert after.versions == ["B-held"]


def test_a_generation_straddling_declared_and_undeclared_weights_is_partial(
    engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]
) -> None:
    _, versions = hold_across_update(engine, stubs, lambda: stubs.load(checkpoints.b))
    assert versions == GenerationVersions(declared=False, partial=True, versions=["A"], revision=None)


def test_bad_generate_gets_its_status_and_the_engine_keeps_serving(
    engine: vpb2_grpc.VllmEngineStub, tokens_a: list[int]
) -> None:
    bad = request()
    bad.data_parallel_rank = 7  # one rank only
    with pytest.raises(grpc.RpcError) as refused:
        generate(engine, bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank" in (refused.value.details() or "")
    assert generate(engine, request())[0] == tokens_a


def generated_tokens(server: ServeProcess) -> float:
    """vLLM's count of tokens its engine generated (its /metrics)."""
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:generation_tokens_total"
    )


def test_a_cancelled_generate_is_aborted_in_the_engine(
    weights_server: ServeProcess, engine: vpb2_grpc.VllmEngineStub, stubs: Stubs, tokens_a: list[int]
) -> None:
    before = generated_tokens(weights_server)
    held = HeldGeneration(engine)
    assert held.first.wait(60)
    held.call.cancel()
    deadline = time.monotonic() + 60
    while (state := stubs.state()).num_running_requests or state.num_waiting_requests:
        assert time.monotonic() < deadline, f"the cancelled request is still in the engine: {state}"
    # Relayed, the cancellation makes vLLM drop the request; else it would run to its end.
    assert generated_tokens(weights_server) - before < HELD_TOKENS
    assert len(held.join()) < HELD_TOKENS
    assert generate(engine, request())[0] == tokens_a


def test_reflection_health_and_server_info_list_the_rollout_service(weights_server: ServeProcess, stubs: Stubs) -> None:
    listed = subprocess.run(
        [str(BIN / "grpcurl"), "-plaintext", weights_server.grpc_target, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert SERVICE in listed.stdout.split(), listed
    with grpc.insecure_channel(weights_server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    info = stubs.updates.GetServerInfo(upb.GetServerInfoRequest())
    assert f"{SERVICE}/Generate" in info.supported_rpcs and "vllm.grpc.engine" in info.api_versions
