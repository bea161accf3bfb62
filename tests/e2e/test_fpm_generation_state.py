"""FPM samples carry each rank's generation state (running, paused and who holds the pause,
applying an update), and the planner exposes it.

The end-to-end tests read the session's `weights_server` (a real engine on the embedded tiny
model, allowed to load the `checkpoints`) over a real StreamForwardPassMetrics call, heartbeats
included, and drive it through the real gRPC API and the HTTP `/pause` route. A change of
state is published at once as a heartbeat, so every window shows on the stream in order,
however short; the reads wait on the stream with a deadline, never on a clock. The server is
left running (forced resume) after every test.

The rules that need states hard to reach on purpose (a partial update) run in their pure
cores, in tests/unit/test_fpm_generation_state.py.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from google.longrunning import operations_pb2, operations_pb2_grpc
from support.fpm_helpers import RUNNING, state
from support.serving import ServeProcess
from support.weights import Checkpoints, greedy_tokens

from enginectl.cli.top import build_frame, render_top
from enginectl.client import Planner
from enginectl.client.fpm import FpmGenerationState
from enginectl.client.planner import RankState
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc

READ_S = 60.0  # deadline of every wait on the stream or the planner
STEP, HEARTBEAT = fpm_pb2.SAMPLE_KIND_STEP, fpm_pb2.SAMPLE_KIND_HEARTBEAT


def windows(samples: list[fpm_pb2.ForwardPassMetrics]) -> list[tuple[str, str]]:
    """The states the samples went through, in order, repeats collapsed."""
    out: list[tuple[str, str]] = []
    for s in samples:
        if not out or out[-1] != state(s):
            out.append(state(s))
    return out


class EngineSamples:
    """The samples a server's own engine publishes, read from one stream (heartbeats
    included) in the order the relay numbered them; nothing may be `missed`."""

    def __init__(self, server: ServeProcess) -> None:
        self._channel = grpc.aio.insecure_channel(server.grpc_target)
        self._incarnation = server.serving["incarnation"]
        self._call = svc_grpc.ForwardPassMetricsServiceStub(self._channel).StreamForwardPassMetrics(
            svc_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True)
        )
        self._pending: list[fpm_pb2.ForwardPassMetrics] = []

    async def start(self) -> EngineSamples:
        first = await asyncio.wait_for(self._call.read(), READ_S)
        assert first.HasField("progress"), first  # live from here on
        return self

    async def until(
        self, done: Callable[[fpm_pb2.ForwardPassMetrics], bool], timeout: float = READ_S
    ) -> list[fpm_pb2.ForwardPassMetrics]:
        """Every sample read up to and including the first one `done` accepts."""
        seen: list[fpm_pb2.ForwardPassMetrics] = []
        deadline = time.monotonic() + timeout
        while True:
            while self._pending:
                sample = self._pending.pop(0)
                seen.append(sample)
                if done(sample):
                    return seen
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no such sample within {timeout}s; read {[state(s) for s in seen]}"
            response = await asyncio.wait_for(self._call.read(), remaining)
            assert response is not grpc.aio.EOF, "the stream ended"
            if response.HasField("batch"):
                assert response.batch.missed == 0, "samples were coalesced away"
                self._pending += [s for s in response.batch.samples if s.incarnation == self._incarnation]

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


@pytest.fixture
async def samples(weights_server: ServeProcess) -> AsyncIterator[EngineSamples]:
    reader = await EngineSamples(weights_server).start()
    yield reader
    await reader.close()


@pytest.fixture
async def updates(weights_server: ServeProcess) -> AsyncIterator[upb_grpc.WeightUpdateServiceStub]:
    """The server's WeightUpdateService; generation runs before the test and after it."""
    async with grpc.aio.insecure_channel(weights_server.grpc_target) as channel:
        stub = upb_grpc.WeightUpdateServiceStub(channel)
        before = await stub.GetGenerationState(upb.GetGenerationStateRequest(), timeout=READ_S)
        assert not before.state.paused, f"another test left the server paused: {before.state}"
        yield stub
        await stub.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=READ_S)


def only_rank(planner: Planner) -> RankState | None:
    ranks = planner.fleet.latest()
    return ranks[0] if ranks else None


def planner_says(generation: FpmGenerationState, reason: str) -> Callable[[Planner], bool]:
    def check(planner: Planner) -> bool:
        rank = only_rank(planner)
        return rank is not None and (rank.generation_state, rank.pause_reason) == (generation, reason)

    return check


# -- a real engine -----------------------------------------------------------------------------


async def test_steps_and_heartbeats_say_running_while_generation_runs(
    weights_server: ServeProcess, samples: EngineSamples, updates: upb_grpc.WeightUpdateServiceStub
) -> None:
    await asyncio.to_thread(greedy_tokens, weights_server)
    seen = await samples.until(lambda s: s.kind == STEP)
    seen += await samples.until(lambda s: s.kind == HEARTBEAT)  # idle again: the next heartbeat
    assert {state(s) for s in seen} == {RUNNING}
    assert seen[-1].idle


async def test_a_caller_pause_shows_at_once_stays_on_heartbeats_and_ends_with_the_resume(
    weights_server: ServeProcess, samples: EngineSamples, updates: upb_grpc.WeightUpdateServiceStub
) -> None:
    async with Planner([weights_server.grpc_target]) as planner:
        assert await planner.wait_for(planner_says(FpmGenerationState.RUNNING, "UNSPECIFIED"), READ_S)
        await updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP), timeout=READ_S)
        # The change itself is a heartbeat made when the rank paused, before any timer ran out.
        paused = (await samples.until(lambda s: state(s) != RUNNING))[-1]
        assert (state(paused), paused.kind) == (("PAUSED", "CALLER"), HEARTBEAT)
        # The heartbeats after it (one per interval, nothing else happens) keep saying it.
        beat = (await samples.until(lambda s: s.counter_id > paused.counter_id))[-1]
        assert (state(beat), beat.kind) == (("PAUSED", "CALLER"), HEARTBEAT)

        # The planner's per-rank view, and `fpm top`'s row, show who holds the pause; the
        # load model keeps the rank's last sample made while it generated.
        assert await planner.wait_for(planner_says(FpmGenerationState.PAUSED, "CALLER"), READ_S)
        rank = only_rank(planner)
        assert rank is not None and not rank.generating
        assert rank.last_running is not None and rank.last_running.generation_state is FpmGenerationState.RUNNING
        assert rank.last_running.counter_id < paused.counter_id
        frame = build_frame(planner, {}, 1.0, ())
        assert [(r.generation_state, r.pause_reason) for r in frame.ranks] == [("PAUSED", "CALLER")]
        assert "PAUSED/CALLER" in render_top(frame)

        await updates.ResumeGeneration(upb.ResumeGenerationRequest(), timeout=READ_S)
        between = await samples.until(lambda s: state(s) == RUNNING)
        assert windows(between[:-1]) in ([], [("PAUSED", "CALLER")])  # heartbeats until the resume
        assert between[-1].kind == HEARTBEAT  # the resume, published at once
        assert await planner.wait_for(planner_says(FpmGenerationState.RUNNING, "UNSPECIFIED"), READ_S)
        rank = only_rank(planner)
        assert rank is not None and rank.generating and rank.last_running == rank.sample


async def test_a_weight_update_shows_its_pause_then_applying_then_running(
    weights_server: ServeProcess,
    samples: EngineSamples,
    updates: upb_grpc.WeightUpdateServiceStub,
    checkpoints: Checkpoints,
) -> None:
    """The update pauses (UPDATE), writes the weights (APPLYING, under its pause), finishes
    paused and resumes: each step is a sample, in that order, however fast the load is."""
    request = upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.a), weight_version="A")
    operation = await updates.UpdateWeightsFromDisk(request, timeout=READ_S)
    async with grpc.aio.insecure_channel(weights_server.grpc_target) as channel:
        done = await operations_pb2_grpc.OperationsStub(channel).WaitOperation(
            operations_pb2.WaitOperationRequest(name=operation.name), timeout=120
        )
    assert done.done and done.WhichOneof("result") == "response", done
    left_running = False

    def resumed(sample: fpm_pb2.ForwardPassMetrics) -> bool:
        nonlocal left_running
        left_running = left_running or state(sample) != RUNNING
        return left_running and state(sample) == RUNNING

    seen = await samples.until(resumed)
    went = windows(seen)
    if went[0] == RUNNING:  # heartbeats from before the update began
        went = went[1:]
    assert went == [("PAUSED", "UPDATE"), ("APPLYING", "UPDATE"), ("PAUSED", "UPDATE"), RUNNING]
    applying = [s for s in seen if state(s)[0] == "APPLYING"]
    assert applying[0].kind == HEARTBEAT and not any(s.kind == STEP for s in applying)


async def test_a_pause_through_vllms_route_name_is_enginectls_caller_pause(
    weights_server: ServeProcess, samples: EngineSamples, updates: upb_grpc.WeightUpdateServiceStub
) -> None:
    """vLLM's HTTP `/pause` used to pause the engine behind enginectl's back (an EXTERNAL pause:
    tests/unit/test_fpm_generation_state.py shows how one is reported). Under enginectl that
    name is PauseGeneration's (docs/http_routes.md): the samples say who paused, the caller."""

    def post(path: str) -> None:
        request = urllib.request.Request(f"{weights_server.http_url}{path}", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=READ_S) as response:
            assert response.status == 200

    await asyncio.to_thread(post, "/pause?mode=keep")
    paused = (await samples.until(lambda s: state(s) != RUNNING))[-1]
    assert state(paused) == ("PAUSED", "CALLER")
    await asyncio.to_thread(post, "/resume")
    between = await samples.until(lambda s: state(s) == RUNNING)
    assert windows(between[:-1]) in ([], [("PAUSED", "CALLER")])
