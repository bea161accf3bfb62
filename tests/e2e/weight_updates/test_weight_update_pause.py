"""Pause modes on a real engine (ABORT, WAIT, KEEP, a WAIT that times out) and the prefix cache
across weight updates.

Every test leaves the session's `weights_server` (tests/e2e/conftest.py) serving checkpoint A,
resumed (fixture `back_to_a`). Tokens are greedy token ids from vLLM's HTTP API.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints, greedy_tokens

from enginectl.weights.v1 import weight_update_service_pb2 as upb

LONG_PROMPT = list(range(3, 3 + 200))  # fills a 128-token KV block (CPU block size): prefix-cached


# --- pause modes -------------------------------------------------------------------------------


class Streaming:
    """A streamed completion in a thread: `first` is set once its first token arrived."""

    def __init__(self, server: ServeProcess, prompt: list[int], max_tokens: int) -> None:
        self.first = threading.Event()
        self.finished = threading.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        body = {
            "model": server.served_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        self._request = urllib.request.Request(
            f"{server.http_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=300) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.token_ids.extend(choice.get("token_ids") or [])
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
                    self.first.set()
        finally:
            self.first.set()
            self.finished.set()

    def wait_started(self) -> Streaming:
        assert self.first.wait(120), "generation did not start"
        return self


def test_pause_abort_ends_in_flight_generation(weights_server: ServeProcess, stubs: Stubs) -> None:
    gen = Streaming(weights_server, [5, 6, 7], max_tokens=200).wait_started()
    paused = stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_ABORT))
    assert paused.state.paused and paused.state.reason == upb.PAUSE_REASON_CALLER
    assert paused.num_aborted_requests == 1
    assert gen.finished.wait(60)
    assert gen.finish_reason == "abort" and len(gen.token_ids) < 200
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    assert not stubs.state().paused


def test_pause_wait_returns_after_in_flight_generation_completes(weights_server: ServeProcess, stubs: Stubs) -> None:
    gen = Streaming(weights_server, [5, 6, 7], max_tokens=48).wait_started()
    paused = stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_WAIT))
    assert paused.state.paused and paused.state.num_running_requests == 0
    assert gen.finished.wait(30)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 48
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())


def test_pause_keep_keeps_generation_and_it_continues_under_new_weights(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints
) -> None:
    prompt, n = [9, 10, 11], 120
    reference = greedy_tokens(weights_server, prompt, max_tokens=n)  # all under A
    gen = Streaming(weights_server, prompt, max_tokens=n).wait_started()
    paused = stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    assert paused.num_paused_requests == 1
    assert paused.state.num_running_requests + paused.state.num_waiting_requests == 1
    kept = len(gen.token_ids)
    response = stubs.load(checkpoints.b, "B-under-keep")
    assert not response.generation_resumed and stubs.state().paused  # the caller paused: stays paused
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    assert gen.finished.wait(120)
    assert gen.finish_reason == "length" and len(gen.token_ids) == n
    assert gen.token_ids[:kept] == reference[:kept]
    assert gen.token_ids != reference  # the rest came from B


def test_update_resets_prefix_cache_by_default(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints
) -> None:
    greedy_tokens(weights_server, LONG_PROMPT)  # caches the prompt's KV under A
    stubs.load(checkpoints.b, "B-stale", reset_prefix_cache=False)
    stale = greedy_tokens(weights_server, LONG_PROMPT)
    stubs.load(checkpoints.b, "B-fresh")  # default: reset
    fresh = greedy_tokens(weights_server, LONG_PROMPT)
    assert stale != fresh, "without a reset, cached KV from A should have leaked into B's answer"
    stubs.load(checkpoints.a, "A")
    greedy_tokens(weights_server, LONG_PROMPT)
    stubs.load(checkpoints.b, "B-again")
    assert greedy_tokens(weights_server, LONG_PROMPT) == fresh


def test_resume_is_refused_during_partial_update_hold_without_force(stubs: Stubs) -> None:
    """Without a partial update there is nothing to force: a plain resume works."""
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    resumed = stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    assert resumed.was_paused and not resumed.state.paused


def test_pause_wait_timeout_resumes(weights_server: ServeProcess, stubs: Stubs) -> None:
    gen = Streaming(weights_server, [5, 6, 7], max_tokens=200).wait_started()
    request = upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_WAIT)
    request.wait_timeout.FromMilliseconds(50)
    with pytest.raises(grpc.RpcError) as raised:
        stubs.updates.PauseGeneration(request)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error_info(raised.value).reason == "PAUSE_TIMEOUT"
    assert not stubs.state().paused
    assert gen.finished.wait(120) and gen.finish_reason == "length"
