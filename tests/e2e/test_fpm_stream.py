"""StreamForwardPassMetrics on a real `enginectl serve` (real engine, relay, gRPC, grpcurl).

One server for the module, with a small ring (`--fpm-ring-size`) so eviction is reachable.
Most samples come from a real ZMQ PUB connected to the server's relay endpoint (see
fpm_helpers.RelayPublisher): it controls the rate and content; each test uses its own worker
id and filters on it, so the engine's own samples and other tests never interfere. One test
drives the engine itself through vLLM's HTTP API and reads the samples its scheduler made.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from itertools import pairwise

import grpc
import pytest
from support.fpm_helpers import (
    HEARTBEAT,
    STEP,
    RelayPublisher,
    frames,
    read_until,
    relay_endpoint,
    request,
)
from support.serving import BIN, ServeProcess

from enginectl.client import AsyncClient, InvalidArgumentError, OutOfRangeError, Reason
from enginectl.client.errors import from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc

RING = 5_000
SERVICE = "enginectl.fpm.v1.ForwardPassMetricsService/StreamForwardPassMetrics"


@pytest.fixture(scope="module")
def fpm_server(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    srv = ServeProcess(["--fpm-ring-size", str(RING)], serve_env).start().wait_ready()
    yield srv
    try:
        assert srv.terminate() == 0
    finally:
        srv.kill()


@pytest.fixture(scope="module")
async def publisher(fpm_server: ServeProcess) -> AsyncIterator[RelayPublisher]:
    pub = RelayPublisher(relay_endpoint(fpm_server))
    await pub.connect(fpm_server.grpc_target)
    yield pub
    pub.close()


@pytest.fixture
async def stub(fpm_server: ServeProcess) -> AsyncIterator[svc_grpc.ForwardPassMetricsServiceStub]:
    async with grpc.aio.insecure_channel(fpm_server.grpc_target) as channel:
        yield svc_grpc.ForwardPassMetricsServiceStub(channel)


def worker() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def first_progress(call: grpc.aio.UnaryStreamCall) -> svc_pb2.ForwardPassMetricsProgress:
    response = await asyncio.wait_for(call.read(), 30)
    assert response.HasField("progress"), "the first message must be a progress message"
    return response.progress


async def test_first_message_is_progress_and_sequences_strictly_increase(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    async with AsyncClient(fpm_server.grpc_target) as client:
        revision = (await client.set_weight_version(f"fpm-{uuid.uuid4()}")).revision
        incarnation = (await client.get_weight_version()).incarnation
    w = worker()
    call = stub.StreamForwardPassMetrics(request([w], include_heartbeats=True))
    progress = await first_progress(call)
    assert progress.incarnation == incarnation and progress.sequence == progress.head_sequence
    n = 2_000
    await asyncio.to_thread(publisher.send_all, frames(w, n // 2) + frames(w, n // 2, kind=HEARTBEAT, start=n // 2 + 1))
    samples, missed, _ = await read_until(call, n)
    call.cancel()
    assert missed == 0
    assert [s.counter_id for s in samples] == list(range(1, n + 1))
    sequences = [s.sequence for s in samples]
    assert sequences[0] > progress.sequence
    assert all(b > a for a, b in pairwise(sequences))
    assert {s.weight_revision for s in samples} == {revision}


async def test_heartbeats_are_left_out_unless_asked_for(
    stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    w = worker()
    call = stub.StreamForwardPassMetrics(request([w]))
    await first_progress(call)
    await asyncio.to_thread(publisher.send_all, frames(w, 10, kind=HEARTBEAT) + frames(w, 5, start=11))
    samples, _, _ = await read_until(call, 5)
    call.cancel()
    assert [(s.kind, s.counter_id) for s in samples] == [(STEP, i) for i in range(11, 16)]


def dropped_unkeyed(server: ServeProcess) -> float:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith('enginectl_fpm_samples_dropped_total{reason="unkeyed"}')]
    return float(line.split()[-1])


async def test_a_sample_without_the_starts_key_is_dropped_and_counted(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    """A publisher that lacks this start's key (another start's, a stranger on the relay's
    TCP endpoint) is never relayed (docs/multinode.md); a keyed sample sent after it, on the
    same socket (ZMQ keeps its order), is."""
    assert publisher.key, "the relay keeps the start's key beside its ipc socket"
    w = worker()
    before = dropped_unkeyed(fpm_server)
    call = stub.StreamForwardPassMetrics(request([w]))
    await first_progress(call)
    publisher.send_unkeyed(frames(w, 1, start=1)[0])
    await asyncio.to_thread(publisher.send_all, frames(w, 1, start=2))
    samples, _, _ = await read_until(call, 1)
    call.cancel()
    assert [s.counter_id for s in samples] == [2]
    assert dropped_unkeyed(fpm_server) == before + 1


async def test_max_batch_size_bounds_every_batch(
    stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    w = worker()
    call = stub.StreamForwardPassMetrics(request([w], max_batch_size=7))
    await first_progress(call)
    await asyncio.to_thread(publisher.send_all, frames(w, 100))
    sizes = []
    got = 0
    while got < 100:
        response = await asyncio.wait_for(call.read(), 30)
        if response.HasField("batch"):
            sizes.append(len(response.batch.samples))
            got += sizes[-1]
    call.cancel()
    assert max(sizes) <= 7 and got == 100


async def test_idle_stream_gets_progress_with_the_current_sequence(
    stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    w = worker()
    await asyncio.to_thread(publisher.send_all, frames(w, 3))
    call = stub.StreamForwardPassMetrics(request([f"{w}-nobody"]))
    first = await first_progress(call)
    t0 = time.monotonic()
    later = await first_progress(call)  # nothing matches: the next message is progress again
    call.cancel()
    assert 0.5 < time.monotonic() - t0 < 10
    assert later.sequence == later.head_sequence >= first.sequence
    assert later.oldest_sequence >= 1


async def test_disconnect_and_resume_gets_every_sample_once(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    """Samples keep flowing while the subscriber is away; the resumed stream replays exactly
    the ones after the last sequence it processed, then goes on live."""
    w, n = worker(), 3_000
    call = stub.StreamForwardPassMetrics(request([w]))
    await first_progress(call)
    sender = asyncio.create_task(asyncio.to_thread(publisher.send_all, frames(w, n), 6_000))
    before, missed, _ = await read_until(call, 800)
    call.cancel()  # disconnect mid-flow
    assert missed == 0
    last = before[-1]
    resumed = stub.StreamForwardPassMetrics(
        request([w], resume_after_sequence=last.sequence, resume_incarnation=fpm_server.serving["incarnation"])
    )
    progress = await first_progress(resumed)
    assert progress.sequence == last.sequence  # the resume point
    after, missed, _ = await read_until(resumed, n - len(before))
    resumed.cancel()
    await sender
    assert missed == 0
    assert [s.counter_id for s in before + after] == list(range(1, n + 1))  # none lost, none twice
    sequences = [s.sequence for s in before + after]
    assert all(b > a for a, b in pairwise(sequences))


async def test_evicted_resume_point_is_out_of_range_with_oldest_available(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    w = worker()
    watch = stub.StreamForwardPassMetrics(request([w]))
    await first_progress(watch)
    await asyncio.to_thread(publisher.send_all, frames(w, RING + 10))
    await read_until(watch, RING + 10)
    watch.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        call = stub.StreamForwardPassMetrics(request(resume_after_sequence=0))
        await first_progress(call)
    err = from_rpc_error(raised.value)
    assert isinstance(err, OutOfRangeError) and err.reason == Reason.SEQUENCE_EVICTED
    oldest, head = int(err.metadata["oldest_sequence"]), int(err.metadata["head_sequence"])
    assert head - oldest + 1 == RING and err.metadata["incarnation"] == fpm_server.serving["incarnation"]
    # Re-syncing knowingly: resume just before the oldest kept replays from there.
    call = stub.StreamForwardPassMetrics(request(resume_after_sequence=oldest - 1, include_heartbeats=True))
    assert (await first_progress(call)).sequence == oldest - 1
    response = await asyncio.wait_for(call.read(), 30)
    call.cancel()
    assert response.batch.samples[0].sequence == oldest


async def test_slow_subscriber_is_told_what_it_missed_while_a_fast_one_misses_none(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    """The slow subscriber reads nothing while 40,000 samples flow (its HTTP/2 window is kept
    small, so the server cannot park them in transport buffers): its queue coalesces and
    the batches it finally reads count what it missed. The fast one reads all along."""
    w, n = worker(), 40_000
    slow_options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * 1024)]
    async with grpc.aio.insecure_channel(fpm_server.grpc_target, options=slow_options) as slow_channel:
        slow = svc_grpc.ForwardPassMetricsServiceStub(slow_channel).StreamForwardPassMetrics(request([w]))
        fast = stub.StreamForwardPassMetrics(request([w]))
        await first_progress(slow)
        await first_progress(fast)
        sender = asyncio.create_task(asyncio.to_thread(publisher.send_all, frames(w, n, ranks=2), 20_000))
        fast_samples, fast_missed, _ = await read_until(fast, n, timeout=120)
        await sender
        slow_samples, slow_missed, _ = await read_until(slow, n, timeout=120)
        slow.cancel()
        fast.cancel()
    assert fast_missed == 0 and [s.counter_id for s in fast_samples] == list(range(1, n + 1))
    assert slow_missed > 0 and len(slow_samples) + slow_missed == n
    # What the slow one kept is in order and ends with the latest sample of each rank.
    kept = [s.sequence for s in slow_samples]
    assert kept == sorted(kept) and {s.counter_id for s in slow_samples} >= {n - 1, n}


@pytest.mark.parametrize(
    ("fields", "reason", "field"),
    [
        ({"filter": svc_pb2.ForwardPassMetricsFilter(worker_ids=[""])}, Reason.FILTER_INVALID, "filter.worker_ids[0]"),
        (
            {"filter": svc_pb2.ForwardPassMetricsFilter(worker_ids=["w" * 257])},
            Reason.FILTER_INVALID,
            "filter.worker_ids[0]",
        ),
        (
            {"filter": svc_pb2.ForwardPassMetricsFilter(worker_ids=[f"w{i}" for i in range(1025)])},
            Reason.FILTER_INVALID,
            "filter.worker_ids",
        ),
        ({"filter": svc_pb2.ForwardPassMetricsFilter(dp_ranks=[0, -1])}, Reason.FILTER_INVALID, "filter.dp_ranks[1]"),
        ({"max_batch_size": 10_001}, Reason.MAX_BATCH_SIZE_TOO_LARGE, "max_batch_size"),
    ],
    ids=["empty-worker-id", "long-worker-id", "too-many-ids", "negative-rank", "batch-too-large"],
)
async def test_bad_requests_are_invalid_argument(
    fpm_server: ServeProcess,
    stub: svc_grpc.ForwardPassMetricsServiceStub,
    fields: dict[str, object],
    reason: str,
    field: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await first_progress(stub.StreamForwardPassMetrics(svc_pb2.StreamForwardPassMetricsRequest(**fields)))  # type: ignore[arg-type]
    err = from_rpc_error(raised.value)
    assert isinstance(err, InvalidArgumentError) and err.reason == reason
    assert [v.field for v in err.field_violations] == [field]
    async with AsyncClient(fpm_server.grpc_target) as client:  # still serving
        await client.get_weight_version()


async def test_unknown_filter_values_are_valid_and_match_nothing(
    stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    w = worker()
    call = stub.StreamForwardPassMetrics(request([f"{w}-unknown", w], dp_ranks=[99]))
    await first_progress(call)
    await asyncio.to_thread(publisher.send_all, frames(w, 5))
    response = await asyncio.wait_for(call.read(), 30)
    call.cancel()
    assert response.HasField("progress")  # the idle progress, no batch


async def test_resume_in_the_future_or_from_another_incarnation_is_out_of_range(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub
) -> None:
    incarnation = str(fpm_server.serving["incarnation"])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await first_progress(stub.StreamForwardPassMetrics(request(resume_after_sequence=10**12)))
    err = from_rpc_error(raised.value)
    assert err.reason == Reason.SEQUENCE_IN_FUTURE and int(err.metadata["head_sequence"]) < 10**12
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await first_progress(
            stub.StreamForwardPassMetrics(request(resume_after_sequence=1, resume_incarnation="a-previous-life"))
        )
    err = from_rpc_error(raised.value)
    assert err.code is grpc.StatusCode.OUT_OF_RANGE and err.reason == Reason.INCARNATION_CHANGED
    assert err.metadata["incarnation"] == incarnation


async def test_grpcurl_streams_fpm_samples(fpm_server: ServeProcess, publisher: RelayPublisher) -> None:
    w = worker()
    cmd = [
        str(BIN / "grpcurl"),
        "-plaintext",
        "-max-time",
        "8",
        "-d",
        json.dumps({"filter": {"worker_ids": [w]}, "include_heartbeats": True}),
        fpm_server.grpc_target,
        SERVICE,
    ]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    # grpcurl prints the first (progress) message once subscribed; then publish.
    first = await asyncio.wait_for(proc.stdout.readuntil(b"}\n}\n"), 30)
    assert json.loads(first)["progress"]["incarnation"] == fpm_server.serving["incarnation"]
    await asyncio.to_thread(publisher.send_all, frames(w, 3))
    rest, _ = await asyncio.wait_for(proc.communicate(), 60)
    messages, text, decoder = [], rest.decode().strip(), json.JSONDecoder()
    while text:  # grpcurl prints one JSON document per message
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    samples = [s for m in messages if "batch" in m for s in m["batch"]["samples"]]
    assert [(s["worker_id"], s["counter_id"]) for s in samples] == [(w, str(i)) for i in (1, 2, 3)]


async def test_engine_steps_publish_samples_with_the_server_incarnation(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub
) -> None:
    """A completion on vLLM's HTTP API makes the real scheduler step: its samples reach the
    stream, stamped by the relay."""
    call = stub.StreamForwardPassMetrics(request(dp_ranks=[0]))
    await first_progress(call)
    body = json.dumps({"model": fpm_server.served_model, "prompt": "hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{fpm_server.http_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=60).read())
    deadline = time.monotonic() + 30
    steps = []
    while not steps:
        assert time.monotonic() < deadline, "no step sample from the engine"
        response = await asyncio.wait_for(call.read(), 30)
        steps = [s for s in response.batch.samples if s.incarnation == fpm_server.serving["incarnation"]]
    call.cancel()
    assert steps[0].kind == STEP and steps[0].sequence > 0 and steps[0].schema_version == 1


async def test_metrics_count_relayed_samples(
    fpm_server: ServeProcess, stub: svc_grpc.ForwardPassMetricsServiceStub, publisher: RelayPublisher
) -> None:
    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"{fpm_server.http_url}/metrics", timeout=30).read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("enginectl_fpm_")
        }

    before = await asyncio.to_thread(scrape)
    w = worker()
    call = stub.StreamForwardPassMetrics(request([w]))
    await first_progress(call)
    await asyncio.to_thread(publisher.send_all, frames(w, 10))
    await read_until(call, 10)  # the relay has counted them once they are streamed
    call.cancel()
    after = await asyncio.to_thread(scrape)
    relayed = "enginectl_fpm_samples_relayed_total"
    assert after[relayed] >= before[relayed] + 10
    assert 'enginectl_fpm_samples_dropped_total{reason="unattributed"}' in after
    assert "enginectl_fpm_subscriber_missed_total" in after
    assert after["enginectl_fpm_samples_coalesced_at_intake_total"] == 0  # 10 samples: never behind


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--fpm-ring-size", "0", "must be at least 1"),
        ("--fpm-subscriber-queue", "many", "invalid integer value"),
    ],
)
def test_bad_relay_flags_are_refused_before_the_engine_starts(
    serve_env: dict[str, str], flag: str, value: str, message: str
) -> None:
    result = subprocess.run(
        [str(BIN / "enginectl"), "serve", flag, value],
        check=False,
        env=serve_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and f"argument {flag}: {message}" in result.stderr
