"""Faults on real processes: a trainer SIGKILLed mid-broadcast, a tensor-stream client killed or
giving up early, CancelOperation before and after writing began, an FPM subscriber killed and
resuming, SIGTERM during an update, and a restart that old positions must not survive.

Every fault happens for real (a child process SIGKILLed at a point it announced, a server
SIGTERMed, a new server started); assertions are on public surfaces only: the Operation's
google.rpc.Status (code, ErrorInfo reason and metadata["cause"]), GetWeightVersion,
GetGenerationState, DestroyWeightsUpdateGroup, the FPM stream, and greedy tokens generated over
vLLM's HTTP API. What each fault must leave behind is the contract of
protos/enginectl/weights/v1/weight_update_service.proto (rule 6: nothing changed before writing
began; PARTIAL_UPDATE, undeclared with `last_failure` and paused after), of
weight_version_service.proto and of forward_pass_metrics_service.proto.

Two servers for the module. The first (`first_life`) records an etag, a watch revision, an FPM
position and an operation name, is SIGTERMed while a tensor stream stalls mid-update, and is
gone. The second (`fault_server`) starts afterwards on the same model: it is the restarted
server the old positions are tried against, and, since every other fault here leaves it usable,
the server of every other test (each test ends serving checkpoint A, declared and resumed:
fixture `recovered`). Child processes are tests/support/fault_procs.py; the helpers that drive
them and check what a fault left behind are tests/support/fault_helpers.py.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import psutil
import pytest
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2
from support.fault_helpers import (
    EXIT_WITHIN_S,
    FAILED_WITHIN_S,
    HEALTH_SERVICES,
    NOT_SERVING,
    WRITTEN_BYTES,
    Child,
    FirstLife,
    Stubs,
    assert_group_destroyed,
    assert_partial,
    assert_recovers,
    assert_unchanged,
    expected_failure,
    failure,
    fpm_position,
    generated,
    health,
    metadata,
    read_samples,
    refused,
    stalled_stream,
    trainer,
)
from support.serving import ServeProcess, alive
from support.weights import Checkpoints, greedy_tokens, start_weights_server, stop_server

from e2e.own_servers import own_checkpoints
from enginectl.client import NotFoundError, TrainerClient
from enginectl.client.errors import EnginectlError, from_rpc_error, from_status
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_svc
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

# --- the first life: recorded, then SIGTERMed mid-update ----------------------------------


checkpoints = own_checkpoints()


@pytest.fixture(scope="module")
def first_life(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[FirstLife]:
    srv = start_weights_server(serve_env, checkpoints)
    stubs = Stubs(srv)
    child: Child | None = None
    children: list[psutil.Process] = []
    try:
        finished = stubs.load(checkpoints.a, "first-life", request_id=str(uuid.uuid4())).name
        version = stubs.version()
        assert version.declared and version.revision > 0
        fpm_sequence, fpm_incarnation = fpm_position(stubs)
        assert fpm_incarnation == version.incarnation

        # A slow update: the client stalls after the first tensors were written.
        child, running = stalled_stream(srv, stubs, checkpoints.file("B"), WRITTEN_BYTES)
        waiter = stubs.ops.WaitOperation.future(
            operations_pb2.WaitOperationRequest(name=running, timeout=duration_pb2.Duration(seconds=600)), timeout=600
        )
        children = srv.descendants()
        assert children, "the engine runs in child processes"
        assert srv.proc is not None
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = srv.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        exit_seconds = time.monotonic() - started
        left = alive(children)
        if code is None:
            srv.kill()
        stream_ended = child.line_or_none(timeout=30) or {"code": "still running", "reason": ""}
        waiter_ended: EnginectlError | operations_pb2.Operation | str
        try:
            waiter_ended = waiter.result(timeout=30)
        except grpc.RpcError as err:
            waiter_ended = from_rpc_error(err)
        except grpc.FutureTimeoutError:
            waiter_ended = "still waiting 30 s after the server exited"
        yield FirstLife(
            incarnation=version.incarnation,
            etag=version.etag,
            revision=version.revision,
            fpm_sequence=fpm_sequence,
            fpm_incarnation=fpm_incarnation,
            finished_operation=finished,
            running_operation=running,
            exit_code=code,
            exit_seconds=exit_seconds,
            stream_ended=stream_ended,
            waiter_ended=waiter_ended,
            left_behind=left,
        )
    finally:
        stubs.close()
        if child is not None:
            child.close()
        srv.kill()
        for process in alive(children):
            process.kill()


def test_sigterm_during_an_update_exits_promptly_and_reaps_everything(first_life: FirstLife) -> None:
    """serve.py: on SIGTERM the engine stops, every child process is reaped, exit code 0; an
    update in flight (its client stalled, its timeout 10 minutes away) does not hold it up."""
    assert first_life.exit_code == 0, (first_life.exit_code, first_life.exit_seconds)
    assert first_life.exit_seconds < EXIT_WITHIN_S, first_life.exit_seconds
    assert not first_life.left_behind, f"children left behind: {first_life.left_behind}"


def test_sigterm_during_an_update_ends_its_calls_with_unavailable(first_life: FirstLife) -> None:
    """The update's own call (the client stream) and a WaitOperation on it end with UNAVAILABLE
    SHUTTING_DOWN (weight_update_service.proto: every RPC may fail with it)."""
    ended = first_life.stream_ended
    assert (ended["code"], ended["reason"]) == ("UNAVAILABLE", "SHUTTING_DOWN"), ended
    waiter = first_life.waiter_ended
    assert not isinstance(waiter, str), waiter
    if isinstance(waiter, operations_pb2.Operation):  # finished by the shutdown before it went
        waiter = from_status(waiter.error)
    assert (waiter.code, waiter.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), waiter


# --- the second life: the module's server -------------------------------------------------


@pytest.fixture(scope="module")
def fault_server(first_life: FirstLife, serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[ServeProcess]:
    """Started after `first_life` ended, on the same model and flags: its restart. Staged
    sets expire after 3 s here (the TTL test)."""
    srv = start_weights_server(serve_env, checkpoints, "--staged-weights-ttl", str(STAGED_TTL_S))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def stubs(fault_server: ServeProcess) -> Iterator[Stubs]:
    s = Stubs(fault_server)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokens_a(fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> list[int]:
    stubs.load(checkpoints.a, "A")
    return greedy_tokens(fault_server)


@pytest.fixture
def recovered(stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]) -> Iterator[None]:
    """After the test, whatever it left: no update running, resumed, serving A declared."""
    yield
    running = stubs.state().update_operation
    if running:
        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=running), timeout=30)
        stubs.finished(running)
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=30)
    stubs.load(checkpoints.a, "A")


def test_restart_refuses_the_old_etag(first_life: FirstLife, stubs: Stubs) -> None:
    before = stubs.version()
    assert before.incarnation != first_life.incarnation
    err = refused(
        lambda: stubs.versions.SetWeightVersion(
            vpb.SetWeightVersionRequest(version="after-restart", etag=first_life.etag), timeout=30
        )
    )
    assert (err.code, err.reason) == (grpc.StatusCode.ABORTED, "ETAG_MISMATCH"), err
    assert err.metadata.get("incarnation") == before.incarnation, err
    assert stubs.version() == before


def test_restart_refuses_the_old_watch_position(first_life: FirstLife, stubs: Stubs) -> None:
    """A watch resumed from the first life's revision and incarnation is refused as the FPM
    stream refuses a resume from another incarnation (OUT_OF_RANGE INCARNATION_CHANGED)."""
    while stubs.version().revision < first_life.revision:  # the old revision exists here too:
        stubs.versions.SetWeightVersion(vpb.SetWeightVersionRequest(version="after-restart"), timeout=30)
    # only the incarnation tells the two apart
    request = vpb.WatchWeightVersionRequest(since_revision=first_life.revision, incarnation=first_life.incarnation)
    current = stubs.version().incarnation
    err = refused(lambda: next(iter(stubs.versions.WatchWeightVersion(request, timeout=30))))
    assert (err.code, err.reason) == (grpc.StatusCode.OUT_OF_RANGE, "INCARNATION_CHANGED"), err
    assert err.metadata.get("incarnation") == current, err


def test_restart_refuses_the_old_fpm_position(first_life: FirstLife, stubs: Stubs) -> None:
    # The old sequence exists here too (heartbeats every second): only the incarnation tells
    # the two apart.
    assert fpm_position(stubs, at_least=first_life.fpm_sequence)[0] >= first_life.fpm_sequence
    request = fpm_svc.StreamForwardPassMetricsRequest(
        resume_after_sequence=first_life.fpm_sequence, resume_incarnation=first_life.fpm_incarnation
    )
    current = stubs.version().incarnation
    err = refused(lambda: next(iter(stubs.fpm.StreamForwardPassMetrics(request, timeout=30))))
    assert (err.code, err.reason) == (grpc.StatusCode.OUT_OF_RANGE, "INCARNATION_CHANGED"), err
    assert err.metadata.get("incarnation") == current, err


def test_restart_forgets_the_old_operations(first_life: FirstLife, stubs: Stubs) -> None:
    for name in (first_life.finished_operation, first_life.running_operation):
        for call in (
            lambda name=name: stubs.ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30),
            lambda name=name: stubs.ops.WaitOperation(operations_pb2.WaitOperationRequest(name=name), timeout=30),
        ):
            err = refused(call)
            assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "OPERATION_NOT_FOUND"), (name, err)


# --- a trainer killed mid-broadcast ---------------------------------------------------------


def test_trainer_killed_mid_broadcast_leaves_a_partial_update_until_one_succeeds(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    group = f"killed-{uuid.uuid4().hex[:8]}"
    half = len(checkpoints.state_dict("B")) // 2
    child, name = trainer(fault_server, checkpoints.file("B"), group, half)
    with child:
        stubs.poll(name, lambda m: m.weights_modified)
        child.kill()  # rank 0 and the TCPStore host, gone mid-broadcast
    op = stubs.finished(name)
    code, reason, cause = failure(op)
    assert metadata(op).weights_modified
    assert cause in ("GROUP_TIMEOUT", "STREAM_BROKEN"), failure(op)
    assert (code, reason, cause) == expected_failure(cause, written=True)
    assert_group_destroyed(stubs, group)
    assert_partial(stubs, op, cause)
    assert_recovers(stubs, fault_server, checkpoints, tokens_a)


def test_trainer_stalled_mid_broadcast_times_out_and_loses_its_group(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    """The trainer stays connected but stops sending: the update's `timeout` ends the receive
    (DEADLINE_EXCEEDED, cause GROUP_TIMEOUT) and the timed-out group is destroyed."""
    group = f"stalled-{uuid.uuid4().hex[:8]}"
    half = len(checkpoints.state_dict("B")) // 2
    child, name = trainer(fault_server, checkpoints.file("B"), group, half)
    with child:  # alive until the end: nothing but the timeout stops the receive
        op = stubs.finished(name)
        assert child.proc.poll() is None
    assert metadata(op).weights_modified
    assert failure(op) == expected_failure("GROUP_TIMEOUT", written=True)
    assert_group_destroyed(stubs, group)
    assert_partial(stubs, op, "GROUP_TIMEOUT")
    assert_recovers(stubs, fault_server, checkpoints, tokens_a)


def test_trainer_killed_before_its_first_tensor_changes_nothing(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    before = stubs.version()
    group = f"killed-early-{uuid.uuid4().hex[:8]}"
    child, name = trainer(fault_server, checkpoints.file("B"), group, 0)
    with child:
        stubs.poll(name, lambda m: m.phase == upb.UPDATE_PHASE_RECEIVING)
        child.kill()
    op = stubs.finished(name)
    assert not metadata(op).weights_modified
    code, reason, cause = failure(op)
    assert reason in ("GROUP_TIMEOUT", "STREAM_BROKEN"), failure(op)
    assert (code, reason, cause) == expected_failure(reason, written=False)
    assert_group_destroyed(stubs, group)
    assert_unchanged(stubs, fault_server, before, tokens_a)


# --- a tensor stream whose client dies or gives up ----------------------------------------


@pytest.mark.parametrize("sent", [0, WRITTEN_BYTES], ids=["after-header", "after-writes"])
def test_tensor_stream_client_killed_is_a_broken_stream(
    sent: int, fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    """A client that dies is STREAM_BROKEN (CANCELLED), never DATA_SIZE_MISMATCH: it did not
    half-close, its connection broke."""
    before = stubs.version()
    child, name = stalled_stream(fault_server, stubs, checkpoints.file("B"), sent)
    with child:
        child.kill()
    op = stubs.finished(name)
    written = bool(sent)
    assert metadata(op).weights_modified == written
    assert failure(op) == expected_failure("STREAM_BROKEN", written)
    if written:
        assert_partial(stubs, op, "STREAM_BROKEN")
        assert_recovers(stubs, fault_server, checkpoints, tokens_a)
    else:
        assert_unchanged(stubs, fault_server, before, tokens_a)


@pytest.mark.parametrize("sent", [0, WRITTEN_BYTES], ids=["after-header", "after-writes"])
def test_tensor_stream_half_closed_early_is_a_size_mismatch(
    sent: int, fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    """A client that half-closes cleanly before the last byte: DATA_SIZE_MISMATCH
    (INVALID_ARGUMENT), on its call and on the Operation."""
    before = stubs.version()
    child, name = stalled_stream(fault_server, stubs, checkpoints.file("B"), sent)
    with child:
        child.release()
        ended = child.line(timeout=FAILED_WITHIN_S)
    op = stubs.finished(name)
    written = bool(sent)
    expected = expected_failure("DATA_SIZE_MISMATCH", written)
    assert failure(op) == expected
    assert (ended["code"], ended["reason"], ended["metadata"].get("cause")) == (
        expected[0].name,
        expected[1],
        expected[2],
    ), ended
    if written:
        assert_partial(stubs, op, "DATA_SIZE_MISMATCH")
        assert_recovers(stubs, fault_server, checkpoints, tokens_a)
    else:
        assert_unchanged(stubs, fault_server, before, tokens_a)


# --- CancelOperation ------------------------------------------------------------------------


def test_cancel_while_a_broadcast_waits_for_its_first_tensor_changes_nothing(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    before = stubs.version()
    group = f"cancelled-{uuid.uuid4().hex[:8]}"
    child, name = trainer(fault_server, checkpoints.file("B"), group, 0, timeout=300.0)  # only the cancel ends it
    with child:  # the trainer stays alive, its group joined, sending nothing
        stubs.poll(name, lambda m: m.phase == upb.UPDATE_PHASE_RECEIVING)
        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=name), timeout=30)
        op = stubs.finished(name)
    assert not metadata(op).weights_modified
    assert failure(op) == (grpc.StatusCode.CANCELLED, "UPDATE_CANCELLED", None)
    assert_group_destroyed(stubs, group)  # "the group is destroyed too"
    assert_unchanged(stubs, fault_server, before, tokens_a)


def test_cancel_after_writing_began_holds_generation_until_a_forced_resume(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    child, name = stalled_stream(fault_server, stubs, checkpoints.file("B"), WRITTEN_BYTES)
    with child:
        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=name), timeout=30)
        op = stubs.finished(name)
        ended = child.line(timeout=30)  # the stream's call ends with the Operation's error
    assert failure(op) == (grpc.StatusCode.CANCELLED, "PARTIAL_UPDATE", "UPDATE_CANCELLED")
    assert (ended["code"], ended["reason"], ended["metadata"].get("cause")) == (
        "CANCELLED",
        "PARTIAL_UPDATE",
        "UPDATE_CANCELLED",
    ), ended
    assert_partial(stubs, op, "UPDATE_CANCELLED")

    resumed = stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True), timeout=30)
    assert resumed.was_paused and not resumed.state.paused
    assert not stubs.state().paused
    assert len(generated(fault_server, 8)) == 8  # generates again, with whatever weights it holds
    # ... and stays quarantined: no router may take it for serving weights nobody can name.
    assert health(stubs) == {name: NOT_SERVING for name in HEALTH_SERVICES}
    version = stubs.version()  # still not confident about them
    assert not version.declared and version.last_failure.cause == "UPDATE_CANCELLED"
    assert_recovers(stubs, fault_server, checkpoints, tokens_a)


# --- a staged set nobody commits ----------------------------------------------------------

STAGED_TTL_S = 3.0


def test_a_staged_set_expires_after_its_ttl_and_a_late_commit_says_so(
    fault_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], recovered: None
) -> None:
    before = stubs.version()
    with TrainerClient(fault_server.grpc_target, timeout=60.0) as c:
        assert c.get_server_info().staged_ttl == STAGED_TTL_S
        staged = c.stage_weights_from_disk(str(checkpoints.b), "expiring")
        assert staged.expire_time is not None
        fault_server.wait_for_event(lambda e: e.get("event") == "staged weights expired", timeout=60)
        assert c.generation_state().staged is None
        with pytest.raises(NotFoundError) as late:
            c.commit_staged_weights(staged.name)
        assert late.value.reason == "STAGED_WEIGHTS_EXPIRED"
        again = c.stage_weights_from_disk(str(checkpoints.b))  # the place is free again
        c.discard_staged_weights(again.name)
    assert_unchanged(stubs, fault_server, before, tokens_a)


# --- an FPM subscriber killed, resuming ----------------------------------------------------


async def test_fpm_subscriber_killed_resumes_every_sample_exactly_once(
    fault_server: ServeProcess, tokens_a: list[int]
) -> None:
    def generate() -> Any:
        return asyncio.to_thread(greedy_tokens, fault_server)  # steps of the real scheduler

    everything = fpm_svc.StreamForwardPassMetricsRequest(include_heartbeats=True)
    async with grpc.aio.insecure_channel(fault_server.grpc_target) as channel:
        stub = fpm_grpc.ForwardPassMetricsServiceStub(channel)
        witness = stub.StreamForwardPassMetrics(everything)  # never disconnects
        assert (await asyncio.wait_for(witness.read(), 30)).HasField("progress")

        with Child("fpm", fault_server.grpc_target) as child:
            progress = (await asyncio.to_thread(child.line, 60))["progress"]
            await generate()
            seen: list[dict[str, Any]] = []
            while len(seen) < 4:  # samples (progress lines come when it was idle for a second)
                line = await asyncio.to_thread(child.line, 60)
                if "sequence" in line:
                    seen.append(line)
            child.kill()
        last, incarnation = seen[-1]["sequence"], progress["incarnation"]
        await generate()  # samples made while it is gone

        resumed = stub.StreamForwardPassMetrics(
            fpm_svc.StreamForwardPassMetricsRequest(
                include_heartbeats=True, resume_after_sequence=last, resume_incarnation=incarnation
            )
        )
        first = await asyncio.wait_for(resumed.read(), 30)
        assert first.HasField("progress") and first.progress.sequence == last, first
        head = first.progress.head_sequence
        assert head > last, "samples were made while the subscriber was gone"
        await generate()  # live ones
        got: list[fpm_pb2.ForwardPassMetrics] = []
        await read_samples(
            resumed, lambda s: any(x.kind == fpm_pb2.SAMPLE_KIND_STEP and x.sequence > head for x in s), got
        )
        resumed.cancel()
        # Every sample after `last`, once, in order: sequences are server-wide and contiguous.
        assert [s.sequence for s in got] == list(range(last + 1, last + 1 + len(got)))
        # The same samples the subscriber that never left received.
        saw: list[fpm_pb2.ForwardPassMetrics] = []
        await read_samples(witness, lambda s: bool(s) and s[-1].sequence >= got[-1].sequence, saw)
        witness.cancel()
        assert got == [s for s in saw if last < s.sequence <= got[-1].sequence]
        assert {s.incarnation for s in got} == {incarnation}
