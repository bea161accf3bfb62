"""The trainer client (enginectl.client.TrainerClient / AsyncTrainerClient) on a real engine.

Each path (gloo broadcast from a trainer subprocess, tensor stream, disk with a progress bar)
turns the greedy tokens of checkpoint A into B's and back, records the right source and
VerifyWeights says MATCH. A trainer that dies or stalls mid-broadcast leaves a PARTIAL_UPDATE
that the next update repairs. Malformed streams get their reasons and change nothing before
the header. Every test leaves this module's own `weights_server` serving A, resumed. The pure
parts (bucket packing, the plain progress bar) are in tests/unit/test_trainer_client.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.serving import ServeProcess
from support.weights import Checkpoints, greedy_tokens

from e2e.own_servers import own_checkpoints, own_weights_server, trainer_client
from e2e.raw_tensor_stream import chunk, header, stream
from enginectl.client import (
    AsyncTrainerClient,
    EnginectlError,
    FailedPreconditionError,
    InvalidArgumentError,
    Reason,
    TrainerClient,
    WeightSource,
)

TRAINER = Path(__file__).resolve().parents[1] / "support" / "trainer_proc.py"
PROC_TIMEOUT_S = 240.0


checkpoints = own_checkpoints()
weights_server = own_weights_server()
client = trainer_client()


@pytest.fixture(scope="module")
def tokens(client: TrainerClient, checkpoints: Checkpoints, weights_server: ServeProcess) -> dict[str, list[int]]:
    """Greedy tokens under A and under B (read through disk loads); the server ends on A."""
    out = {}
    for which in ("B", "A"):
        client.update_weights_from_disk(str(checkpoints.file(which)), f"ref-{which}")
        out[which] = greedy_tokens(weights_server)
    assert out["A"] != out["B"], "checkpoints A and B must generate different tokens"
    return out


@pytest.fixture
def back_to_a(client: TrainerClient, checkpoints: Checkpoints) -> Iterator[None]:
    """After the test: serving A, declared, resumed, whatever the test left behind."""
    yield
    state = client.generation_state()
    if state.paused and state.reason == "CALLER":
        client.resume_generation()
    client.update_weights_from_disk(str(checkpoints.file("A")), "A")
    assert not client.generation_state().paused


def run_trainer(
    server: ServeProcess, file: Path, version: str, mode: str, timeout: float = 120.0
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TRAINER), server.grpc_target, str(file), version, mode, str(timeout)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(PROC_TIMEOUT_S)
        assert proc.stderr is not None
        pytest.fail(f"trainer exited {proc.returncode} without a result:\n{proc.stderr.read()[-4000:]}")
    return dict(json.loads(line))


def assert_serving(
    client: TrainerClient, server: ServeProcess, tokens: list[int], version: str, source: WeightSource
) -> None:
    wv = client.get_weight_version()
    assert (wv.declared, wv.version, wv.source, wv.last_failure) == (True, version, source, None)
    assert client.verify_weights().verdict == "MATCH"
    assert not client.generation_state().paused
    assert greedy_tokens(server) == tokens


def test_gloo_broadcast_from_trainer_subprocess(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    for which in ("B", "A"):
        proc = run_trainer(weights_server, checkpoints.file(which), f"gloo-{which}", "full")
        result = first_line(proc)
        assert proc.wait(PROC_TIMEOUT_S) == 0
        assert result["version"] == f"gloo-{which}"
        assert result["tensors"] == len(checkpoints.state_dict(which))
        assert_serving(client, weights_server, tokens[which], f"gloo-{which}", WeightSource.DISTRIBUTED)
        assert client.verify_weights(full=True).verdict == "MATCH"
    # The trainer destroyed its group: the name is free on the server.
    assert client.destroy_weights_update_group("test-trainer", allow_missing=True) is False


def test_tensor_stream_a_to_b_and_back(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    for which in ("B", "A"):
        state = checkpoints.state_dict(which)
        # Small chunks: chunks end inside tensors and span several.
        result = client.update_weights_from_tensors(state, f"stream-{which}", chunk_bytes=100_000)
        assert result.weight_version.source == WeightSource.TENSORS
        assert result.ranks[0].tensors_loaded == len(state)
        assert result.ranks[0].bytes_loaded == sum(t.numel() * t.element_size() for t in state.values())
        assert result.prefix_cache_reset and result.generation_resumed
        assert_serving(client, weights_server, tokens[which], f"stream-{which}", WeightSource.TENSORS)


def test_tensor_stream_of_an_nn_module_async(
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    client: TrainerClient,
    back_to_a: None,
) -> None:
    """A Hugging Face model's state_dict names are checkpoint names: the async client streams
    the nn.Module itself."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints.b))

    async def main() -> Any:
        async with AsyncTrainerClient(weights_server.grpc_target) as c:
            return await c.update_weights_from_tensors(model, "async-B")

    result = asyncio.run(main())
    assert result.weight_version.version == "async-B"
    assert greedy_tokens(weights_server) == tokens["B"]


def test_disk_update_with_progress_bar(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    capfd: pytest.CaptureFixture[str],
    back_to_a: None,
) -> None:
    result = client.update_weights_from_disk(str(checkpoints.b), "disk-B", progress=True)
    err = capfd.readouterr().err
    assert "weights" in err and "B" in err, err  # the bar: "weights ... MB" / tqdm's "weights: ...B"
    assert result.weight_version.source == WeightSource.DISK
    assert_serving(client, weights_server, tokens["B"], "disk-B", WeightSource.DISK)
    # wait=False returns the running Operation; wait_operation finishes it.
    op = client.update_weights_from_disk(str(checkpoints.a), "disk-A", wait=False)
    assert op.name.startswith("operations/")
    done = client.wait_operation(op.name, timeout=120)
    assert done.done and done.result().weight_version.version == "disk-A"
    assert_serving(client, weights_server, tokens["A"], "disk-A", WeightSource.DISK)


def assert_partial(client: TrainerClient, name: str, causes: set[str], wait: float = 120.0) -> None:
    op = client.wait_operation(name, timeout=wait)
    assert op.done and op.error is not None, op
    assert op.error.reason == Reason.PARTIAL_UPDATE, op.error
    assert op.error.metadata["cause"] in causes, op.error
    assert op.progress.weights_modified and op.progress.phase == "FAILED"
    wv = client.get_weight_version()
    assert not wv.declared and wv.version is None
    assert wv.last_failure is not None and wv.last_failure.reason == Reason.PARTIAL_UPDATE
    assert wv.last_failure.operation == name
    state = client.generation_state()
    assert state.paused and state.reason == "PARTIAL_UPDATE"
    with pytest.raises(FailedPreconditionError) as refused:
        client.resume_generation()
    assert refused.value.reason == Reason.PARTIAL_UPDATE


def repair(client: TrainerClient, server: ServeProcess, checkpoints: Checkpoints, tokens: dict[str, list[int]]) -> None:
    result = client.update_weights_from_tensors(checkpoints.state_dict("A"), "repaired")
    assert result.generation_resumed
    assert_serving(client, server, tokens["A"], "repaired", WeightSource.TENSORS)


def test_trainer_killed_mid_broadcast_leaves_partial_update_until_repaired(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    proc = run_trainer(weights_server, checkpoints.file("B"), "never", "die", timeout=30.0)
    started = first_line(proc)
    assert proc.wait(PROC_TIMEOUT_S) == 3
    # Within its deadline: the update's 30 s timeout plus the server's grace for the workers.
    assert_partial(client, started["operation"], {"GROUP_TIMEOUT", "STREAM_BROKEN"}, wait=60.0)
    repair(client, weights_server, checkpoints, tokens)


def test_cancel_mid_broadcast_leaves_partial_update_until_repaired(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    proc = run_trainer(weights_server, checkpoints.file("B"), "never", "stall", timeout=120.0)
    try:
        started = first_line(proc)
        assert client.get_operation(started["operation"]).done is False
        client.cancel_operation(started["operation"])
        assert_partial(client, started["operation"], {"UPDATE_CANCELLED"})
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(PROC_TIMEOUT_S)
    repair(client, weights_server, checkpoints, tokens)


def test_in_process_sender_stops_with_the_operations_error_after_cancel(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    """The trainer's own broadcast does not hang when the server gives up: sending the rest
    (or waiting) raises the Operation's error, and the group is gone on both sides."""
    state = checkpoints.state_dict("B")
    client.init_weights_update_group("in-process", timeout=60.0)
    broadcast = client.start_broadcast(state, "never", group_name="in-process", timeout=120.0, bucket_bytes=0)
    assert broadcast.send(len(state) // 2) == len(state) // 2
    client.cancel_operation(broadcast.name)
    with pytest.raises(EnginectlError) as err:
        broadcast.send()
        broadcast.wait(60.0)
    assert err.value.reason == Reason.PARTIAL_UPDATE and err.value.metadata["cause"] == "UPDATE_CANCELLED"
    assert_partial(client, broadcast.name, {"UPDATE_CANCELLED"})
    assert client.destroy_weights_update_group("in-process", allow_missing=True) is False
    repair(client, weights_server, checkpoints, tokens)


def test_bucketed_broadcasts_load_the_same_bytes_as_per_tensor_ones(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    """One collective per tensor, buckets mixing packed and lone tensors, and one bucket for
    everything all leave the model byte for byte as loading B from disk does (full digests
    per rank), generating B's tokens."""
    state = checkpoints.state_dict("B")
    client.update_weights_from_disk(str(checkpoints.file("B")), "disk-B")
    reference = [r.current_digest for r in client.verify_weights(full=True).ranks]
    sizes = sorted(t.numel() * t.element_size() for t in state.values())
    client.init_weights_update_group("buckets", timeout=60.0)
    try:
        for bucket_bytes in (0, sizes[len(sizes) // 2], sum(sizes)):
            client.update_weights_from_disk(str(checkpoints.file("A")), "A")
            version = f"bucketed-{bucket_bytes}"
            result = client.broadcast_weights(state, version, group_name="buckets", bucket_bytes=bucket_bytes)
            assert [r.tensors_loaded for r in result.ranks] == [len(state)] * len(result.ranks)
            verification = client.verify_weights(full=True)
            assert verification.verdict == "MATCH", bucket_bytes
            assert [r.current_digest for r in verification.ranks] == reference, bucket_bytes
            assert_serving(client, weights_server, tokens["B"], version, WeightSource.DISTRIBUTED)
    finally:
        client.destroy_weights_update_group("buckets", allow_missing=True)


def test_a_groups_io_threads_may_run_on_every_engine_core(client: TrainerClient, weights_server: ServeProcess) -> None:
    """vLLM's CPU worker binds itself to the cores it computes on (on a 2-core machine one of
    two), and a thread inherits the binding of the thread that starts it. The threads a group starts in
    the worker (gloo's and its store's I/O) only move bytes: they may run on every core the
    engine may use (worker/weights/cores.py), so a broadcast's receive runs beside the load
    instead of taking turns with it. The worker's own binding is left as it was."""
    import os

    workers = [p for p in weights_server.descendants() if "Worker" in p.name()]
    assert workers, [p.name() for p in weights_server.descendants()]
    worker = workers[0]
    engine = set(os.sched_getaffinity(weights_server.pid))
    for process in weights_server.descendants():
        engine |= set(os.sched_getaffinity(process.pid))
    bound = set(os.sched_getaffinity(worker.pid))
    before = {t.id for t in worker.threads()}
    client.init_weights_update_group("cores", timeout=60.0)
    try:
        started = [t.id for t in worker.threads() if t.id not in before]
        assert started, "joining a group started no thread in the worker"
        assert {tid: set(os.sched_getaffinity(tid)) for tid in started} == dict.fromkeys(started, engine)
        assert set(os.sched_getaffinity(worker.pid)) == bound
    finally:
        client.destroy_weights_update_group("cores", allow_missing=True)


def test_distributed_bucket_bytes_over_the_bound_is_refused(client: TrainerClient, checkpoints: Checkpoints) -> None:
    before = client.get_weight_version()
    client.init_weights_update_group("too-big-buckets", timeout=60.0)
    try:
        with pytest.raises(InvalidArgumentError) as err:
            client.start_broadcast(
                checkpoints.state_dict("B"), "never", group_name="too-big-buckets", bucket_bytes=(4 << 30) + 1
            )
        assert err.value.reason == Reason.BUCKET_BYTES_INVALID
        assert client.get_weight_version() == before
    finally:
        client.destroy_weights_update_group("too-big-buckets", allow_missing=True)


# --- malformed tensor streams ----------------------------------------------------------


def test_bad_streams_get_their_reasons_and_change_nothing(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    client.update_weights_from_disk(str(checkpoints.a), "A")
    before = client.get_weight_version()
    state = checkpoints.state_dict("B")
    total = sum(t.numel() * t.element_size() for t in state.values())
    first = next(iter(state.values()))
    small = first.numel() * first.element_size() // 2  # less than the first tensor: nothing written
    cases = [
        ([], grpc.StatusCode.INVALID_ARGUMENT, Reason.HEADER_REQUIRED),
        ([chunk(0, b"x" * 16)], grpc.StatusCode.INVALID_ARGUMENT, Reason.HEADER_REQUIRED),
        ([header({"no.such.weight": first})], grpc.StatusCode.INVALID_ARGUMENT, Reason.TENSOR_MISMATCH),
        ([header(state), chunk(8, b"x" * 16)], grpc.StatusCode.INVALID_ARGUMENT, Reason.CHUNK_OUT_OF_ORDER),
        (
            [header(state), chunk(0, b"x" * 16), chunk(0, b"x" * 16)],
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.CHUNK_OUT_OF_ORDER,
        ),
        (
            [header(state), chunk(0, b"x" * (4 * 1024 * 1024 + 1))],
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.CHUNK_TOO_LARGE,
        ),
        ([header(state), chunk(0, b"")], grpc.StatusCode.INVALID_ARGUMENT, Reason.CHUNK_TOO_LARGE),
        ([header(state), chunk(0, b"x" * (total + 1))], grpc.StatusCode.INVALID_ARGUMENT, Reason.DATA_SIZE_MISMATCH),
        ([header(state), chunk(0, b"x" * small)], grpc.StatusCode.INVALID_ARGUMENT, Reason.DATA_SIZE_MISMATCH),
        ([header(state), header(state)], grpc.StatusCode.INVALID_ARGUMENT, Reason.HEADER_REQUIRED),
    ]
    for messages, code, reason in cases:
        err = stream(weights_server, messages)
        assert (err.code, err.reason) == (code, reason), (reason, err)
        after = client.get_weight_version()
        assert (after.etag, after.version, after.last_failure) == (before.etag, "A", None), (reason, after)
        assert not client.generation_state().paused, reason
    assert greedy_tokens(weights_server) == tokens["A"]
    assert client.verify_weights().verdict == "MATCH"
    with pytest.raises(ValueError):
        client.update_weights_from_tensors(state, "x", chunk_bytes=4 * 1024 * 1024 + 1)


# --- NCCL ------------------------------------------------------------------------------


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA: NCCL is available")
def test_nccl_group_is_refused_without_gpus(client: TrainerClient) -> None:
    assert "NCCL" not in client.get_server_info().backends
    assert {"DISK", "GLOO", "TENSOR_STREAM"} <= set(client.get_server_info().backends)
    with pytest.raises(FailedPreconditionError) as err:
        client.init_weights_update_group("nccl-group", backend="nccl", timeout=10.0)
    assert err.value.reason == Reason.BACKEND_UNAVAILABLE
    assert client.destroy_weights_update_group("nccl-group", allow_missing=True) is False


@pytest.mark.skipif(
    not _has_cuda(), reason="NCCL needs a CUDA GPU on the trainer and the engine; this machine has none"
)
def test_nccl_broadcast_on_gpus(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    """NCCL runs the same bucketed code as gloo (common/buckets.py): per tensor and bucketed,
    B's tokens and a full MATCH."""
    client.init_weights_update_group("nccl-group", backend="nccl")
    try:
        for bucket_bytes in (0, 1 << 20):
            client.update_weights_from_disk(str(checkpoints.file("A")), "A")
            version = f"nccl-B-{bucket_bytes}"
            state = checkpoints.state_dict("B")
            result = client.broadcast_weights(state, version, group_name="nccl-group", bucket_bytes=bucket_bytes)
            assert result.weight_version.source == WeightSource.DISTRIBUTED
            assert_serving(client, weights_server, tokens["B"], version, WeightSource.DISTRIBUTED)
            assert client.verify_weights(full=True).verdict == "MATCH"
    finally:
        client.destroy_weights_update_group("nccl-group", allow_missing=True)


# --- pause -----------------------------------------------------------------------------


def test_paused_context_manager_holds_generation_across_an_update(
    client: TrainerClient,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    tokens: dict[str, list[int]],
    back_to_a: None,
) -> None:
    with client.paused("keep") as paused:
        assert not paused.was_paused
        state = client.generation_state()
        assert state.paused and state.reason == "CALLER" and state.mode == "KEEP"
        result = client.update_weights_from_disk(str(checkpoints.b), "paused-B")
        assert not result.generation_resumed
        assert client.generation_state().reason == "CALLER"
    assert not client.generation_state().paused
    assert greedy_tokens(weights_server) == tokens["B"]

    async def main() -> str:
        async with AsyncTrainerClient(weights_server.grpc_target) as c, c.paused("abort"):
            return (await c.generation_state()).reason

    assert asyncio.run(main()) == "CALLER"
    assert not client.generation_state().paused
    with pytest.raises(ValueError):
        client.pause_generation("sometimes")


def test_blocking_watch_sees_an_update(client: TrainerClient, checkpoints: Checkpoints, back_to_a: None) -> None:
    """TrainerClient has the watch of the blocking Client: it yields the version an update declared."""
    now = client.get_weight_version()
    watch = client.watch_weight_version(since_revision=now.revision, incarnation=now.incarnation)
    result = client.update_weights_from_disk(str(checkpoints.a), f"watched-{now.revision}")
    for seen in watch:
        if seen.revision >= result.weight_version.revision:
            break
    watch.close()
    assert seen == result.weight_version
    assert (seen.version, seen.source) == (f"watched-{now.revision}", WeightSource.DISK)


def test_invalid_update_raises_before_anything_changes(client: TrainerClient, checkpoints: Checkpoints) -> None:
    before = client.get_weight_version()
    with pytest.raises(InvalidArgumentError) as err:
        client.update_weights_from_disk(str(checkpoints.a), "")
    assert err.value.reason == Reason.VERSION_REQUIRED
    assert client.get_weight_version().etag == before.etag


def test_client_imports_and_connects_without_torch() -> None:
    """`enginectl.client` (the pip-installable client) must not need torch until tensors are sent."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from enginectl.client import AsyncTrainerClient, TrainerClient\n"
        "t = TrainerClient('127.0.0.1:1'); t.close()\n"
        "assert 'vllm' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
