"""Helpers for tests/e2e/test_faults.py: child processes of tests/support/fault_procs.py (`Child`),
blocking stubs with Operation polling (`Stubs`), the failure each fault must end in and what it
must leave behind (rule 6 of weight_update_service.proto: `assert_unchanged` before writing
began, `assert_partial` after, `assert_recovers` once an update succeeds), and readers of the
FPM stream."""

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginectl.client.errors import EnginectlError, from_rpc_error, from_status
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_svc
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from support.serving import ServeProcess
from support.weights import Checkpoints, WeightStubs, greedy_tokens

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
    """A tests/support/fault_procs.py child: `line()` reads the next JSON line it printed."""

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
        "model": server.served_model,
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
    # Quarantined: routers and readiness probes take it out while the weights may be mixed.
    assert health(stubs) == {name: NOT_SERVING for name in HEALTH_SERVICES}


HEALTH_SERVICES = ("", "enginectl.weights.v1.WeightUpdateService", "enginectl.weights.v1.WeightVersionService")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(stubs: WeightStubs) -> dict[str, int]:
    """gRPC health of the whole server ("") and of the weight services."""
    check = health_pb2_grpc.HealthStub(stubs.channel).Check
    return {name: check(health_pb2.HealthCheckRequest(service=name), timeout=30).status for name in HEALTH_SERVICES}


def assert_recovers(stubs: Stubs, server: ServeProcess, checkpoints: Checkpoints, tokens: list[int]) -> None:
    """A successful update repairs a partial one: declared, no last_failure, resumed, A's tokens."""
    done = stubs.load(checkpoints.a, "recovered")
    response = upb.UpdateWeightsResponse()
    done.response.Unpack(response)
    assert response.generation_resumed
    version = stubs.version()
    assert (version.declared, version.version, version.HasField("last_failure")) == (True, "recovered", False)
    assert not stubs.state().paused
    assert health(stubs) == {name: SERVING for name in HEALTH_SERVICES}
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


# --- what the first life leaves, and the FPM stream ------------------------------------


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


def fpm_position(stubs: Stubs, at_least: int = 1) -> tuple[int, str]:
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


async def read_samples(
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
