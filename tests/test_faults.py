"""Faults on real processes: a trainer SIGKILLed mid-broadcast, a tensor-stream client killed
or giving up early, CancelOperation before and after writing began, an FPM subscriber killed
and resuming, SIGTERM during an update, and a restart that old positions must not survive.

Every fault happens for real (a child process SIGKILLed at a point it announced, a server
SIGTERMed, a new server started); assertions are on public surfaces only: the Operation's
google.rpc.Status (code, ErrorInfo reason and metadata["cause"]), GetWeightVersion,
GetGenerationState, DestroyWeightsUpdateGroup, the FPM stream, and greedy tokens generated
over vLLM's HTTP API. What each fault must leave behind is the contract of
protos/enginectl/weights/v1/weight_update_service.proto (rule 6: nothing changed before
writing began; PARTIAL_UPDATE, undeclared with `last_failure` and paused after), of
weight_version_service.proto and of forward_pass_metrics_service.proto.

Two servers for the module. The first (`first_life`) records an etag, a watch revision, an
FPM position and an operation name, is SIGTERMed while a tensor stream stalls mid-update,
and is gone. The second (`fault_server`) starts afterwards on the same model: it is the
restarted server the old positions are tried against, and, since every other fault here
leaves it usable, the server of every other test (each test ends serving checkpoint A,
declared and resumed: fixture `recovered`). Child processes are tests/fault_procs.py.
"""

# ruff: noqa: F811 (pytest fixtures imported from weights_fixtures are parameters here)
from __future__ import annotations

import asyncio
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2
from serving import ServeProcess, alive
from weights_fixtures import (  # noqa: F401
    Checkpoints,
    WeightStubs,
    checkpoints,
    greedy_tokens,
    start_weights_server,
    stop_server,
)

from enginectl.client.errors import EnginectlError, from_rpc_error, from_status
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_svc
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

FAULT_PROCS = Path(__file__).with_name("fault_procs.py")
UPDATE_TIMEOUT_S = 5.0  # short `timeout` of the broadcasts a trainer dies in
FAILED_WITHIN_S = 60.0  # an update whose sender died ends within this (its timeout + grace)
EXIT_WITHIN_S = 60.0  # SIGTERM to exit
WRITTEN_BYTES = 600_000  # a stream that stalls here has written lm_head and embed_tokens
# The gRPC code of each failure cause (weight_update_service.proto, the Operations' errors).
CAUSE_CODES = {
    "GROUP_TIMEOUT": grpc.StatusCode.DEADLINE_EXCEEDED,
    "STREAM_BROKEN": grpc.StatusCode.CANCELLED,
    "UPDATE_CANCELLED": grpc.StatusCode.CANCELLED,
    "DATA_SIZE_MISMATCH": grpc.StatusCode.INVALID_ARGUMENT,
}


# --- helpers -----------------------------------------------------------------------------


class Child:
    """A tests/fault_procs.py child: `line()` reads the next JSON line it printed."""

    def __init__(self, *args: str) -> None:
        self.mode = args[0]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(FAULT_PROCS), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def line(self, timeout: float = 120.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"{self.mode}: no line within {timeout}s\n{self.stderr()}")
        return self._parse(line)

    def line_or_none(self, timeout: float) -> dict[str, Any] | None:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._parse(line)

    def _parse(self, line: str | None) -> dict[str, Any]:
        if line is None:
            self.proc.wait(30)
            pytest.fail(f"{self.mode} exited {self.proc.returncode} without a line\n{self.stderr()}")
        return dict(json.loads(line))

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def release(self) -> None:
        """Write a line on its stdin (a stalled stream half-closes)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL, and reap."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stubs(WeightStubs):
    timeout = 30.0

    def __init__(self, server: ServeProcess) -> None:
        super().__init__(server)
        self.fpm = fpm_grpc.ForwardPassMetricsServiceStub(self.channel)

    def poll(
        self, name: str, until: Callable[[upb.UpdateWeightsMetadata], bool], timeout: float = FAILED_WITHIN_S
    ) -> operations_pb2.Operation:
        """The Operation once `until(metadata)` holds or it is done; WaitOperation's own
        timeout paces the polling."""
        deadline = time.monotonic() + timeout
        while True:
            op = self.ops.WaitOperation(
                operations_pb2.WaitOperationRequest(name=name, timeout=duration_pb2.Duration(nanos=200_000_000)),
                timeout=30,
            )
            if op.done or until(metadata(op)):
                return op
            assert time.monotonic() < deadline, f"{name} not there within {timeout}s: {metadata(op)}"

    def finished(self, name: str, timeout: float = FAILED_WITHIN_S) -> operations_pb2.Operation:
        op = self.ops.WaitOperation(
            operations_pb2.WaitOperationRequest(name=name, timeout=duration_pb2.Duration(seconds=int(timeout))),
            timeout=timeout + 30,
        )
        assert op.done, f"{name} still running {timeout}s later: {metadata(op)}"
        return op

    def load(self, path: Path, version: str, request_id: str = "") -> operations_pb2.Operation:
        """UpdateWeightsFromDisk, waited for; fails the test unless it succeeded."""
        op = self.updates.UpdateWeightsFromDisk(
            upb.UpdateWeightsFromDiskRequest(path=str(path), weight_version=version, request_id=request_id), timeout=60
        )
        done = self.finished(op.name, 120.0)
        assert done.WhichOneof("result") == "response", from_status(done.error)
        return done

    def close(self) -> None:
        self.channel.close()


def metadata(op: operations_pb2.Operation) -> upb.UpdateWeightsMetadata:
    meta = upb.UpdateWeightsMetadata()
    op.metadata.Unpack(meta)
    return meta


def refused(call: Callable[[], object]) -> EnginectlError:
    """The error `call` raises (it must raise a gRPC error)."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return from_rpc_error(raised.value)


def failure(op: operations_pb2.Operation) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, reason, metadata["cause"]) of a failed Operation."""
    assert op.done and op.HasField("error"), op
    err = from_status(op.error)
    return err.code, err.reason, err.metadata.get("cause")


def expected_failure(cause: str, written: bool) -> tuple[grpc.StatusCode, str, str | None]:
    """What the proto promises for `cause`: its own reason before writing began, PARTIAL_UPDATE
    with metadata["cause"] after (rule 6); the code is the cause's either way."""
    return CAUSE_CODES[cause], "PARTIAL_UPDATE" if written else cause, cause if written else None


def generated(server: ServeProcess, n: int) -> list[int]:
    """The token ids of an `n`-token completion (EOS ignored: mixed weights may emit it)."""
    body = {
        "model": server.model,
        "prompt": [1, 2, 3],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return list(json.load(response)["choices"][0]["token_ids"])


def assert_unchanged(stubs: Stubs, server: ServeProcess, before: wv.WeightVersion, tokens: list[int]) -> None:
    """Rule 6, before writing began: version, revision and etag as they were, generation
    resumed, the same tokens."""
    assert stubs.version() == before
    assert not stubs.state().paused, stubs.state()
    assert greedy_tokens(server) == tokens


def assert_partial(stubs: Stubs, op: operations_pb2.Operation, cause: str) -> None:
    """Rule 6, after writing began: undeclared with last_failure, held paused; a plain resume
    is refused."""
    version = stubs.version()
    assert not version.declared and not version.HasField("version"), version
    failed = version.last_failure
    assert (failed.reason, failed.cause, failed.operation) == ("PARTIAL_UPDATE", cause, op.name), version
    state = stubs.state()
    assert state.paused and state.reason == upb.PAUSE_REASON_PARTIAL_UPDATE, state
    err = refused(lambda: stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(), timeout=30))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PARTIAL_UPDATE"), err


def assert_recovers(stubs: Stubs, server: ServeProcess, checkpoints: Checkpoints, tokens: list[int]) -> None:
    """A successful update repairs a partial one: declared, no last_failure, resumed, A's tokens."""
    done = stubs.load(checkpoints.a, "recovered")
    response = upb.UpdateWeightsResponse()
    done.response.Unpack(response)
    assert response.generation_resumed
    version = stubs.version()
    assert (version.declared, version.version, version.HasField("last_failure")) == (True, "recovered", False)
    assert not stubs.state().paused
    assert greedy_tokens(server) == tokens


def assert_group_destroyed(stubs: Stubs, group: str) -> None:
    """A broadcast that timed out, broke or was cancelled can not be reused: the group is gone."""
    err = refused(
        lambda: stubs.updates.DestroyWeightsUpdateGroup(
            upb.DestroyWeightsUpdateGroupRequest(group_name=group), timeout=60
        )
    )
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "GROUP_NOT_FOUND"), err


def stalled_stream(server: ServeProcess, stubs: Stubs, file: Path, send_bytes: int) -> tuple[Child, str]:
    """A child streaming `file` that stalls after `send_bytes`, once the server is at that
    point: waiting for chunks (nothing sent), or with tensors written."""
    request_id = str(uuid.uuid4())
    child = Child("stream", server.grpc_target, str(file), request_id, "never", str(send_bytes))
    try:
        assert child.line()["sent"] == send_bytes
        server.wait_for_event(
            lambda e: e.get("event") == "weight update started" and e.get("request_id") == request_id, timeout=60
        )
        name = f"operations/{request_id}"
        if send_bytes:
            op = stubs.poll(name, lambda m: m.weights_modified)
        else:
            op = stubs.poll(name, lambda m: m.phase == upb.UPDATE_PHASE_RECEIVING)
        assert not op.done, from_status(op.error)
    except BaseException:
        child.close()
        raise
    return child, name


def trainer(
    server: ServeProcess, file: Path, group: str, count: int, timeout: float = UPDATE_TIMEOUT_S
) -> tuple[Child, str]:
    """A trainer child that broadcast `count` tensors of `file` (update `timeout`) and now
    waits; the Operation name."""
    child = Child("broadcast", server.grpc_target, str(file), group, "never", str(count), str(timeout))
    try:
        started = child.line(timeout=180)
    except BaseException:
        child.close()
        raise
    assert started["sent"] == count
    return child, str(started["operation"])


# --- the first life: recorded, then SIGTERMed mid-update ----------------------------------


@dataclass
class FirstLife:
    """What a client held from the first server, and how that server's SIGTERM went."""

    incarnation: str
    etag: str
    revision: int
    fpm_sequence: int
    fpm_incarnation: str
    finished_operation: str
    running_operation: str
    exit_code: int | None
    exit_seconds: float
    stream_ended: dict[str, Any]
    waiter_ended: EnginectlError | operations_pb2.Operation | str
    left_behind: list[psutil.Process]


def _fpm_position(stubs: Stubs, at_least: int = 1) -> tuple[int, str]:
    """(sequence, incarnation) of the first sample a subscriber reads whose sequence is at least
    `at_least` (heartbeats come every second while idle)."""
    call = stubs.fpm.StreamForwardPassMetrics(
        fpm_svc.StreamForwardPassMetricsRequest(include_heartbeats=True), timeout=60
    )
    incarnation = ""
    try:
        for response in call:
            if response.HasField("progress"):
                incarnation = response.progress.incarnation
            elif response.batch.samples and response.batch.samples[-1].sequence >= at_least:
                return response.batch.samples[-1].sequence, incarnation
    finally:
        call.cancel()
    raise AssertionError("the FPM stream ended without a sample")


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
        fpm_sequence, fpm_incarnation = _fpm_position(stubs)
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
    """Started after `first_life` ended, on the same model and flags: its restart."""
    srv = start_weights_server(serve_env, checkpoints)
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
    assert _fpm_position(stubs, at_least=first_life.fpm_sequence)[0] >= first_life.fpm_sequence
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
    version = stubs.version()  # still not confident about them
    assert not version.declared and version.last_failure.cause == "UPDATE_CANCELLED"
    assert_recovers(stubs, fault_server, checkpoints, tokens_a)


# --- an FPM subscriber killed, resuming ----------------------------------------------------


async def _read_samples(
    call: grpc.aio.UnaryStreamCall,
    until: Callable[[list[fpm_pb2.ForwardPassMetrics]], bool],
    samples: list[fpm_pb2.ForwardPassMetrics],
    timeout: float = 60.0,
) -> None:
    """Append the stream's samples to `samples` until `until(samples)`; no sample may be missed."""
    deadline = time.monotonic() + timeout
    while not until(samples):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"stream stopped short after {len(samples)} samples"
        response = await asyncio.wait_for(call.read(), remaining)
        assert response is not grpc.aio.EOF, "stream ended"
        if response.HasField("batch"):
            assert response.batch.missed == 0
            samples.extend(response.batch.samples)


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
        await _read_samples(
            resumed, lambda s: any(x.kind == fpm_pb2.SAMPLE_KIND_STEP and x.sequence > head for x in s), got
        )
        resumed.cancel()
        # Every sample after `last`, once, in order: sequences are server-wide and contiguous.
        assert [s.sequence for s in got] == list(range(last + 1, last + 1 + len(got)))
        # The same samples the subscriber that never left received.
        saw: list[fpm_pb2.ForwardPassMetrics] = []
        await _read_samples(witness, lambda s: bool(s) and s[-1].sequence >= got[-1].sequence, saw)
        witness.cancel()
        assert got == [s for s in saw if last < s.sequence <= got[-1].sequence]
        assert {s.incarnation for s in got} == {incarnation}
