"""Weight updates on a real engine: disk loads, VerifyWeights (and a load that bypasses enginectl),
ordering with SetWeightVersion, the operator's view (GetServerInfo, Operations over grpcurl, the
CLI). Validation before anything is touched is in test_weight_update_refusals.py, pause modes
and the prefix cache in test_weight_update_pause.py; their stubs in
tests/support/weight_updates.py, their fixtures in this folder's conftest.py. How a worker reads
a checkpoint from disk is checked without a server in tests/unit/test_weight_update.py.

Every test leaves the session's `weights_server` (tests/e2e/conftest.py) serving checkpoint A,
resumed (fixture `back_to_a`). Tokens are greedy token ids from vLLM's HTTP API.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from support.serving import BIN, ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints, greedy_tokens

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb


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


def test_disk_update_is_prepared_on_every_worker_before_it_starts(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints
) -> None:
    """Before a disk update exists, every worker of every rank opened the checkpoint's file
    and compared its header with the one the server planned from (WorkerRpc.PREPARE, DESIGN
    §13 "Prepare before write"), then the update ran as before. A checkpoint a worker can not
    read as planned is refused there (tests/unit/test_prepare_before_write.py)."""
    request_id = str(uuid.uuid4())
    stubs.load(checkpoints.b, "step-prepared", request_id=request_id)
    num_workers = stubs.updates.GetServerInfo(upb.GetServerInfoRequest()).num_workers
    mine = [e for e in weights_server.events() if e.get("request_id") == request_id]
    events = [e["event"] for e in mine]
    assert events.index("update prepared") < events.index("weight update started"), events
    prepared = mine[events.index("update prepared")]
    assert (prepared["files"], prepared["workers"]) == (1, num_workers)
    assert stubs.version().version == "step-prepared"


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


def test_operations_list_in_pages_newest_first_and_refuse_a_forged_token(
    stubs: Stubs, checkpoints: Checkpoints
) -> None:
    for version in ("page-a", "page-b", "page-c"):
        stubs.load(checkpoints.b, version)
    everything = stubs.ops.ListOperations(operations_pb2.ListOperationsRequest(filter="done=true")).operations
    assert len(everything) >= 3
    paged: list[operations_pb2.Operation] = []
    request = operations_pb2.ListOperationsRequest(filter="done=true", page_size=2)
    while True:
        page = stubs.ops.ListOperations(request)
        assert 1 <= len(page.operations) <= 2
        paged.extend(page.operations)
        if not page.next_page_token:
            break
        request.page_token = page.next_page_token
    assert [op.name for op in paged] == [op.name for op in everything]
    newest = []
    for op in everything[:3]:
        metadata = upb.UpdateWeightsMetadata()
        op.metadata.Unpack(metadata)
        newest.append(metadata.weight_version)
    assert newest == ["page-c", "page-b", "page-a"]
    for forged in ("-1", " 1", "1.0", "\u0663", "x"):  # \u0663: an Arabic-Indic 3, which int() takes
        with pytest.raises(grpc.RpcError) as refused:
            stubs.ops.ListOperations(operations_pb2.ListOperationsRequest(page_token=forged))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, forged
        assert error_info(refused.value).reason == "PAGE_TOKEN_INVALID", forged


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
    loaded = 'enginectl_weight_update_bytes_total{source="disk"}'
    assert 0 < after[loaded] - before.get(loaded, 0.0) <= size


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
