"""Weight updates on a real engine: disk loads, validation before anything is touched, pause
modes, the prefix cache, VerifyWeights (and a load that bypasses enginectl), ordering with
SetWeightVersion, Operations over grpcurl.

Every test leaves the shared `weights_server` serving checkpoint A, resumed (fixture
`back_to_a`). Tokens are greedy token ids from vLLM's HTTP API.
"""

from __future__ import annotations

# ruff: noqa: F811 (pytest fixtures imported from weights_fixtures are parameters here)
import json
import pickle
import shutil
import subprocess
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from serving import BIN, ServeProcess
from weights_fixtures import Checkpoints, WeightStubs, checkpoints, greedy_tokens, weights_server  # noqa: F401

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

LONG_PROMPT = list(range(3, 3 + 200))  # fills a 128-token KV block (CPU block size): prefix-cached


class Stubs(WeightStubs):
    def wait(self, op: operations_pb2.Operation, timeout: float = 120.0) -> operations_pb2.Operation:
        done = self.ops.WaitOperation(operations_pb2.WaitOperationRequest(name=op.name), timeout=timeout)
        assert done.done, done
        return done

    def load(self, path: Path, version: str | None = None, **fields: Any) -> upb.UpdateWeightsResponse:
        request = upb.UpdateWeightsFromDiskRequest(path=str(path), **fields)
        if version is not None:
            request.weight_version = version
        done = self.wait(self.updates.UpdateWeightsFromDisk(request))
        assert done.WhichOneof("result") == "response", done.error
        response = upb.UpdateWeightsResponse()
        done.response.Unpack(response)
        return response

    def verify(self, full: bool = False) -> vpb.VerifyWeightsResponse:
        return self.versions.VerifyWeights(vpb.VerifyWeightsRequest(full=full))


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, err
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


@pytest.fixture(scope="module")
def stubs(weights_server: ServeProcess) -> Stubs:
    return Stubs(weights_server)


@pytest.fixture(scope="module")
def tokens_a(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> list[int]:
    stubs.load(checkpoints.a, "A")
    return greedy_tokens(weights_server)


@pytest.fixture(scope="module")
def tokens_b(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]) -> list[int]:
    stubs.load(checkpoints.b, "B")
    tokens = greedy_tokens(weights_server)
    stubs.load(checkpoints.a, "A")
    assert tokens != tokens_a, "checkpoint B must generate differently from A"
    return tokens


@pytest.fixture(autouse=True)
def back_to_a(stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]) -> Iterator[None]:
    yield
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True))
    stubs.load(checkpoints.a, "A")


def test_disk_update_turns_a_into_b_and_back(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], tokens_b: list[int]
) -> None:
    before = stubs.version()
    response = stubs.load(checkpoints.b, "step-1")
    assert greedy_tokens(weights_server) == tokens_b
    version = stubs.version()
    assert (version.declared, version.version, version.source) == (True, "step-1", wv.WEIGHT_SOURCE_DISK)
    assert version.revision == before.revision + 1
    assert response.weight_version == version
    [rank] = response.ranks
    assert rank.tensors_loaded == len(checkpoints.state_dict("B")) and rank.bytes_loaded > 0
    assert response.prefix_cache_reset and response.generation_resumed
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH
    assert not stubs.state().paused

    stubs.load(checkpoints.a, "step-2")
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH


def test_update_without_version_leaves_it_undeclared(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    stubs.load(checkpoints.b)
    version = stubs.version()
    assert not version.declared and not version.HasField("version")
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_UNDECLARED
    assert greedy_tokens(weights_server) == tokens_b


def test_operation_metadata_reports_progress(stubs: Stubs, checkpoints: Checkpoints) -> None:
    done = stubs.wait(
        stubs.updates.UpdateWeightsFromDisk(
            upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.b), weight_version="meta")
        )
    )
    metadata = upb.UpdateWeightsMetadata()
    done.metadata.Unpack(metadata)
    assert metadata.phase == upb.UPDATE_PHASE_DONE and metadata.source == wv.WEIGHT_SOURCE_DISK
    assert metadata.tensors_done == metadata.tensors_total == len(checkpoints.state_dict("B"))
    assert metadata.bytes_done == metadata.bytes_total > 0
    assert metadata.weights_modified and metadata.paused_by_update
    listed = stubs.ops.ListOperations(operations_pb2.ListOperationsRequest(filter="done=true"))
    assert listed.operations[0].name == done.name
    assert stubs.ops.GetOperation(operations_pb2.GetOperationRequest(name=done.name)) == done


def test_updates_are_counted_on_metrics(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> None:
    def counted() -> dict[str, float]:
        with urllib.request.urlopen(f"{weights_server.http_url}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        return {
            line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in lines
            if line.startswith(("enginectl_weight_updates_total", "enginectl_weight_update_bytes_total"))
        }

    before = counted()
    stubs.load(checkpoints.b, "counted")
    after = counted()
    ok = 'enginectl_weight_updates_total{result="ok",source="disk"}'
    assert after[ok] == before.get(ok, 0.0) + 1
    size = (checkpoints.b / "model.safetensors").stat().st_size
    assert (
        0
        < after["enginectl_weight_update_bytes_total"] - before.get("enginectl_weight_update_bytes_total", 0.0)
        <= size
    )


def test_bypass_load_is_drifted(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH
    # vLLM's own route, enginectl not involved: the label still says "A".
    body = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints.b)}}).encode()
    request = urllib.request.Request(
        f"{weights_server.http_url}/collective_rpc", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    assert stubs.version().version == "A"
    drifted = stubs.verify()
    assert drifted.verdict == vpb.VERIFY_VERDICT_DRIFTED
    [rank] = drifted.ranks
    assert rank.verdict == vpb.VERIFY_VERDICT_DRIFTED and rank.recorded_digest != rank.current_digest
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_DRIFTED
    # vLLM's reload of B and enginectl's disk update of B produce the same model.
    weights_server_tokens = greedy_tokens(weights_server)
    assert weights_server_tokens == tokens_b


def test_set_version_sent_during_an_update_applies_after_it(stubs: Stubs, checkpoints: Checkpoints) -> None:
    op = stubs.updates.UpdateWeightsFromDisk(
        upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.b), weight_version="from-update")
    )
    # Sent after the update was accepted: waits for it, then applies.
    declared = stubs.versions.SetWeightVersion(vpb.SetWeightVersionRequest(version="declared-later"))
    done = stubs.wait(op)
    response = upb.UpdateWeightsResponse()
    done.response.Unpack(response)
    assert response.weight_version.version == "from-update"
    assert declared.weight_version.revision == response.weight_version.revision + 1
    final = stubs.version()
    assert (final.version, final.source) == ("declared-later", wv.WEIGHT_SOURCE_DECLARED)
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH


# --- rejected before touching weights ----------------------------------------------------------


def _save(path: Path, tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


class _Payload:
    """Unpickling this would create a marker file: proof a pickle was never opened."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _bad_inputs(ckpt: Checkpoints, tmp: Path) -> dict[str, tuple[Any, grpc.StatusCode, str]]:
    import torch

    state = ckpt.state_dict("A")
    embed = "model.embed_tokens.weight"
    outside = tmp / "outside"
    shutil.copytree(ckpt.b, outside, dirs_exist_ok=True)
    escape = ckpt.root / "escape"
    escape.mkdir(exist_ok=True)
    link = escape / "model.safetensors"
    if not link.exists():
        link.symlink_to(outside / "model.safetensors")
    pickled = ckpt.root / "pickled"
    pickled.mkdir(exist_ok=True)
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Payload(tmp / "unpickled")}))
    truncated = ckpt.root / "truncated" / "model.safetensors"
    truncated.parent.mkdir(exist_ok=True)
    data = (ckpt.b / "model.safetensors").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    disk = upb.UpdateWeightsFromDiskRequest
    invalid, denied = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    return {
        "unknown tensor": (
            disk(
                path=str(_save(ckpt.root / "unknown/model.safetensors", {"model.bogus.weight": torch.zeros(4)})),
                weight_version="x",
            ),
            invalid,
            "TENSOR_MISMATCH",
        ),
        "wrong shape": (
            disk(
                path=str(_save(ckpt.root / "shape/model.safetensors", {embed: torch.zeros(3, 7)})), weight_version="x"
            ),
            invalid,
            "TENSOR_MISMATCH",
        ),
        "wrong dtype": (
            disk(
                path=str(
                    _save(
                        ckpt.root / "dtype/model.safetensors",
                        {embed: torch.zeros(state[embed].shape, dtype=torch.int64)},
                    )
                ),
                weight_version="x",
            ),
            invalid,
            "TENSOR_MISMATCH",
        ),
        "outside the allowed roots": (disk(path=str(outside), weight_version="x"), denied, "PATH_NOT_ALLOWED"),
        "symlink escape": (disk(path=str(escape), weight_version="x"), denied, "PATH_NOT_ALLOWED"),
        "pickle .bin file": (
            disk(path=str(pickled / "pytorch_model.bin"), weight_version="x"),
            invalid,
            "UNSUPPORTED_FORMAT",
        ),
        "directory of pickles": (disk(path=str(pickled), weight_version="x"), invalid, "UNSUPPORTED_FORMAT"),
        "truncated safetensors": (disk(path=str(truncated), weight_version="x"), invalid, "UNSUPPORTED_FORMAT"),
        "relative path": (disk(path="B/model.safetensors", weight_version="x"), invalid, "PATH_INVALID"),
        "missing file": (
            disk(path=str(ckpt.root / "nope"), weight_version="x"),
            grpc.StatusCode.NOT_FOUND,
            "PATH_NOT_FOUND",
        ),
        "oversize version": (disk(path=str(ckpt.b), weight_version="v" * 257), invalid, "VERSION_TOO_LONG"),
        "bad pause mode": (disk(path=str(ckpt.b), weight_version="x", pause_mode=99), invalid, "PAUSE_MODE_INVALID"),
        "stale etag": (
            disk(path=str(ckpt.b), weight_version="x", etag="0" * 20),
            grpc.StatusCode.ABORTED,
            "ETAG_MISMATCH",
        ),
        "missing group": (
            upb.UpdateWeightsFromDistributedRequest(
                group_name="no-such-group",
                weight_version="x",
                tensors=[upb.TensorSpec(name=embed, dtype=upb.TENSOR_DTYPE_FLOAT32, shape=list(state[embed].shape))],
            ),
            grpc.StatusCode.NOT_FOUND,
            "GROUP_NOT_FOUND",
        ),
    }


CASES = [
    "unknown tensor",
    "wrong shape",
    "wrong dtype",
    "outside the allowed roots",
    "symlink escape",
    "pickle .bin file",
    "directory of pickles",
    "truncated safetensors",
    "relative path",
    "missing file",
    "oversize version",
    "bad pause mode",
    "stale etag",
    "missing group",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_update_is_refused_before_touching_weights(
    case: str, weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], tmp_path: Path
) -> None:
    request, code, reason = _bad_inputs(checkpoints, tmp_path)[case]
    before = stubs.version()
    ops_before = len(stubs.ops.ListOperations(operations_pb2.ListOperationsRequest()).operations)
    call = (
        stubs.updates.UpdateWeightsFromDisk
        if isinstance(request, upb.UpdateWeightsFromDiskRequest)
        else stubs.updates.UpdateWeightsFromDistributed
    )
    with pytest.raises(grpc.RpcError) as raised:
        call(request)
    assert raised.value.code() == code, raised.value.details()
    assert error_info(raised.value).reason == reason
    assert stubs.version() == before  # version, revision and etag unchanged
    assert len(stubs.ops.ListOperations(operations_pb2.ListOperationsRequest()).operations) == ops_before
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a  # still serving, weights untouched
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH
    assert not (tmp_path / "unpickled").exists(), "a pickle was opened"


def test_second_concurrent_update_is_refused_and_cancel_changes_nothing(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]
) -> None:
    """A tensor stream whose sender stalls after its header holds the one update slot."""
    import queue

    state = checkpoints.state_dict("B")
    request_id = str(uuid.uuid4())
    header = upb.TensorStreamHeader(
        weight_version="stalled",
        request_id=request_id,
        tensors=[upb.TensorSpec(name=n, dtype=upb.TENSOR_DTYPE_FLOAT32, shape=list(t.shape)) for n, t in state.items()],
    )
    gate: queue.Queue[None] = queue.Queue()

    def messages() -> Iterator[upb.UpdateWeightsFromTensorsRequest]:
        yield upb.UpdateWeightsFromTensorsRequest(header=header)
        gate.get()

    before = stubs.version()
    call = stubs.updates.UpdateWeightsFromTensors.future(messages())
    try:
        running = _running_operation(weights_server, stubs, request_id)
        with pytest.raises(grpc.RpcError) as raised:
            stubs.updates.UpdateWeightsFromDisk(upb.UpdateWeightsFromDiskRequest(path=str(checkpoints.b)))
        assert raised.value.code() == grpc.StatusCode.ABORTED
        info = error_info(raised.value)
        assert info.reason == "UPDATE_IN_PROGRESS" and info.metadata["operation"] == running.name
        assert stubs.state().paused and stubs.state().update_operation == running.name

        stubs.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=running.name))
        done = stubs.wait(running)
        assert done.error.code == grpc.StatusCode.CANCELLED.value[0]
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=60)
        assert error_info(ended.value).reason == "UPDATE_CANCELLED"
    finally:
        gate.put(None)
    assert stubs.version() == before  # nothing was written: no partial update
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a


def _running_operation(server: ServeProcess, stubs: Stubs, request_id: str) -> operations_pb2.Operation:
    """The update `request_id`, once the server logged that it started."""
    server.wait_for_event(lambda e: e.get("event") == "weight update started" and e.get("request_id") == request_id)
    return stubs.ops.GetOperation(operations_pb2.GetOperationRequest(name=f"operations/{request_id}"))


# --- pause modes -------------------------------------------------------------------------------


class Streaming:
    """A streamed completion in a thread: `first` is set once its first token arrived."""

    def __init__(self, server: ServeProcess, prompt: list[int], max_tokens: int) -> None:
        self.first = threading.Event()
        self.finished = threading.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        body = {
            "model": server.model,
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


# --- operator view -----------------------------------------------------------------------------


def test_server_info_lists_backends_of_this_machine(stubs: Stubs, checkpoints: Checkpoints) -> None:
    info = stubs.updates.GetServerInfo(upb.GetServerInfoRequest())
    assert upb.UPDATE_BACKEND_DISK in info.backends and upb.UPDATE_BACKEND_GLOO in info.backends
    assert upb.UPDATE_BACKEND_TENSOR_STREAM in info.backends
    assert upb.UPDATE_BACKEND_NCCL not in info.backends  # no CUDA here
    assert info.fingerprint_method.endswith("+gemv-probe")  # the CPU build repacks linear layers
    assert info.full_fingerprint_method.startswith("full-")
    assert str(checkpoints.root.resolve()) in info.allowed_weight_roots
    assert "google.longrunning.Operations/WaitOperation" in info.supported_rpcs


def test_grpcurl_starts_an_update_and_waits_for_its_operation(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    def grpcurl(method: str, body: dict[str, Any]) -> dict[str, Any]:
        out = subprocess.run(
            [str(BIN / "grpcurl"), "-plaintext", "-d", json.dumps(body), weights_server.grpc_target, method],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    started = grpcurl(
        "enginectl.weights.v1.WeightUpdateService/UpdateWeightsFromDisk",
        {"path": str(checkpoints.b), "weightVersion": "via-grpcurl"},
    )
    assert started["name"].startswith("operations/")
    done = grpcurl("google.longrunning.Operations/WaitOperation", {"name": started["name"], "timeout": "60s"})
    assert done["done"] is True
    assert done["response"]["@type"].endswith("enginectl.weights.v1.UpdateWeightsResponse")
    response = done["response"]
    assert response.get("weightVersion", response.get("weight_version"))["version"] == "via-grpcurl"
    assert done["metadata"]["phase"] == "UPDATE_PHASE_DONE"
    assert greedy_tokens(weights_server) == tokens_b


def test_cli_loads_verifies_pauses_and_reports_errors(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_b: list[int]
) -> None:
    def cli(*words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "enginectl"), "--target", weights_server.grpc_target, *words],
            capture_output=True,
            text=True,
            timeout=120,
        )

    loaded = cli("weights", "load", str(checkpoints.b), "--version", "from-cli")
    assert loaded.returncode == 0, loaded.stderr
    assert '"from-cli"' in loaded.stdout and greedy_tokens(weights_server) == tokens_b
    assert stubs.version().source == wv.WEIGHT_SOURCE_DISK
    verified = cli("weights", "verify", "--full")
    assert verified.returncode == 0 and "MATCH" in verified.stdout, verified.stderr
    assert cli("generation", "pause").returncode == 0 and stubs.state().paused
    assert cli("generation", "resume").returncode == 0 and not stubs.state().paused
    refused = cli("weights", "load", "relative/path")
    assert refused.returncode == 1 and "PATH_INVALID" in refused.stderr
    assert stubs.version().version == "from-cli"
