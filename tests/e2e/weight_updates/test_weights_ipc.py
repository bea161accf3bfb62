"""Same-host updates by reference (UpdateWeightsFromIpc) on a real engine.

The trainer here is the pytest process; the engine's worker is another process of the
session's `weights_server`, so every handle crosses a process boundary as it would from a
trainer. An IPC update of checkpoint B's tensors generates what the tensor stream of the same
tensors generates, declares its version with source IPC, passes VerifyWeights(full), leaves
no mapping behind in the engine and the trainer's tensors unchanged; `zero_copy=True` takes
that path on a loopback target. Refusals change nothing: another host (NOT_SAME_HOST),
malformed handles (IPC_HANDLE_INVALID), names and shapes the model can not take
(TENSOR_MISMATCH). A handle no worker can map (a vanished segment, or one smaller than its
handle) fails the Operation with IPC_HANDLE_UNAVAILABLE before any weight is written, even
when it is the last one, and the engine keeps serving. The CUDA path runs only where CUDA is.
The worker's own mapping, the handle checks at their edges and the token the RPC needs are
checked without a server, in tests/unit/test_weights_ipc.py.

Every test leaves the session's `weights_server` serving checkpoint A, resumed (`back_to_a`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.serving import ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints, greedy_tokens

from e2e.own_servers import trainer_client
from enginectl.client import InvalidArgumentError, Reason, TrainerClient, WeightSource
from enginectl.client.trainer_ipc import ipc_request, is_local_target
from enginectl.client.trainer_requests import UpdateOptions
from enginectl.client.trainer_tensors import named_tensors
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

EMBED = "model.embed_tokens.weight"


client = trainer_client()


@pytest.fixture(scope="module")
def states(checkpoints: Checkpoints) -> dict[str, dict[str, Any]]:
    """A's and B's tensors, held by this module (shared memory once sent by reference)."""
    return {which: checkpoints.state_dict(which) for which in ("A", "B")}


# --- helpers ----------------------------------------------------------------------------


def request_for(state: dict[str, Any], version: str | None = None) -> upb.UpdateWeightsFromIpcRequest:
    """The UpdateWeightsFromIpc request TrainerClient sends for `state` (shares it)."""
    return UpdateOptions(version, timeout=60.0).fill(ipc_request(named_tensors(state, device=None), 0))


def segments(state: dict[str, Any]) -> set[str]:
    """The shared-memory segments holding `state` (already shared: the call only reads)."""
    return {t.untyped_storage()._share_filename_cpu_()[1].decode() for t in state.values()}


def engine_mappings(server: ServeProcess) -> set[str]:
    """The /dev/shm/torch_* segments that the server and its engine processes map now."""
    found = set()
    for pid in [server.pid, *(p.pid for p in server.descendants())]:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/torch_" in line:
                        found.add("/" + line.split("/dev/shm/", 1)[1].split()[0])
        except FileNotFoundError:
            continue
    return found


def operation_error(
    done: operations_pb2.Operation,
) -> tuple[int, error_details_pb2.ErrorInfo, upb.UpdateWeightsMetadata]:
    """(status code, ErrorInfo, metadata) of a failed Operation."""
    assert done.done and done.WhichOneof("result") == "error", done
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in done.error.details if d.Is(info.DESCRIPTOR)), done.error
    metadata = upb.UpdateWeightsMetadata()
    done.metadata.Unpack(metadata)
    return done.error.code, info, metadata


def violations(err: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The BadRequest field violations of a refused call."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, err
    found = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            found.extend(bad.field_violations)
    return found


def snapshot(stubs: Stubs) -> tuple[wv.WeightVersion, set[str]]:
    """The version resource and the names of every Operation, as they are now."""
    ops = stubs.ops.ListOperations(operations_pb2.ListOperationsRequest(name="operations", page_size=100))
    return stubs.version(), {op.name for op in ops.operations}


def assert_unchanged(
    stubs: Stubs, server: ServeProcess, before: tuple[wv.WeightVersion, set[str]], tokens: list[int]
) -> None:
    version, names = snapshot(stubs)
    assert (version.version, version.etag, version.revision) == (
        before[0].version,
        before[0].etag,
        before[0].revision,
    )
    assert names == before[1], "a refused update must create no Operation"
    assert not stubs.state().paused
    assert greedy_tokens(server) == tokens


# --- loading by reference ---------------------------------------------------------------------


def test_ipc_loads_what_the_tensor_stream_loads(
    client: TrainerClient,
    stubs: Stubs,
    weights_server: ServeProcess,
    checkpoints: Checkpoints,
    states: dict[str, dict[str, Any]],
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    streamed = client.update_weights_from_tensors(states["B"], "stream-B")
    assert greedy_tokens(weights_server) == tokens_b
    for which, tokens in (("A", tokens_a), ("B", tokens_b), ("A", tokens_a), ("B", tokens_b)):
        # B twice: the second update sends the same segments again, without moving anything.
        result = client.update_weights_from_ipc(states[which], f"ipc-{which}")
        assert greedy_tokens(weights_server) == tokens
        served = client.get_weight_version()
        assert (served.declared, served.version, served.source) == (True, f"ipc-{which}", WeightSource.IPC)
        assert result.weight_version.source == WeightSource.IPC
        assert result.prefix_cache_reset and result.generation_resumed
        assert result.ranks[0].tensors_loaded == len(states[which])
        assert result.ranks[0].bytes_loaded == streamed.ranks[0].bytes_loaded
        assert client.verify_weights(full=True).verdict == "MATCH"
        # The engine dropped every mapping; the trainer's tensors are as they were.
        assert not engine_mappings(weights_server) & segments(states[which])
    fresh = checkpoints.state_dict("B")
    assert all(t.is_shared() and t.equal(fresh[n]) for n, t in states["B"].items())


def test_zero_copy_takes_the_ipc_path_on_loopback(
    client: TrainerClient, weights_server: ServeProcess, states: dict[str, dict[str, Any]], tokens_b: list[int]
) -> None:
    assert is_local_target(client.config.target)
    result = client.update_weights_from_tensors(states["B"], "zero-copy-B", zero_copy=True)
    assert result.weight_version.source == WeightSource.IPC
    assert greedy_tokens(weights_server) == tokens_b
    with pytest.raises(ValueError, match="zero_copy"):
        client.update_weights_from_tensors(states["B"], "zero-copy-B", zero_copy=True, wait=False)


# --- refused before anything is touched ------------------------------------------------------


def test_another_host_is_refused_and_nothing_changes(
    stubs: Stubs, weights_server: ServeProcess, states: dict[str, dict[str, Any]], tokens_a: list[int]
) -> None:
    before = snapshot(stubs)
    for change in (
        lambda host: setattr(host, "boot_id", str(uuid.uuid4())),
        lambda host: setattr(host, "hostname", host.hostname + "-elsewhere"),
        lambda host: host.Clear(),
    ):
        request = request_for(states["B"], "elsewhere")
        change(request.host)
        with pytest.raises(grpc.RpcError) as refused:
            stubs.updates.UpdateWeightsFromIpc(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(refused.value)
        assert info.reason == Reason.NOT_SAME_HOST
        assert info.metadata["trainer_host"] != info.metadata["server_host"]
    assert_unchanged(stubs, weights_server, before, tokens_a)


def _bad_handles() -> dict[str, tuple[Callable[[upb.UpdateWeightsFromIpcRequest], None], str, str]]:
    """What to break in a good request, the reason and the field it is refused with."""

    def last(request: upb.UpdateWeightsFromIpcRequest) -> upb.IpcTensorHandle:
        return request.handles[len(request.handles) - 1]

    return {
        "one handle short": (lambda r: r.handles.pop(), Reason.IPC_HANDLE_INVALID, "handles"),
        "no storage": (
            lambda r: last(r).ClearField("shared_memory"),
            Reason.IPC_HANDLE_INVALID,
            "required: shared_memory or cuda",
        ),
        "a name torch does not make": (
            lambda r: setattr(last(r).shared_memory, "segment_name", "/../../etc/passwd"),
            Reason.IPC_HANDLE_INVALID,
            ".shared_memory.segment_name",
        ),
        "a stride missing": (lambda r: last(r).stride.pop(), Reason.IPC_HANDLE_INVALID, ".stride"),
        "a negative stride": (
            lambda r: last(r).stride.__setitem__(0, -1),
            Reason.IPC_HANDLE_INVALID,
            ".stride",
        ),
        "past the storage's end": (
            lambda r: setattr(last(r), "storage_offset", 1),
            Reason.IPC_HANDLE_INVALID,
            ".shared_memory.storage_nbytes",
        ),
        "CUDA shares not one per worker": (
            lambda r: last(r).cuda.SetInParent(),
            Reason.IPC_HANDLE_INVALID,
            ".cuda.shares",
        ),
        "an unknown name": (
            lambda r: setattr(r.tensors[0], "name", "model.bogus.weight"),
            Reason.TENSOR_MISMATCH,
            "tensors[0]",
        ),
        "another shape": (
            lambda r: r.tensors[0].shape.__setitem__(0, r.tensors[0].shape[0] - 1),
            Reason.TENSOR_MISMATCH,
            "tensors[0]",
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_handles()))
def test_malformed_requests_are_refused_and_nothing_changes(
    case: str, stubs: Stubs, weights_server: ServeProcess, states: dict[str, dict[str, Any]], tokens_a: list[int]
) -> None:
    breaks, reason, field = _bad_handles()[case]
    before = snapshot(stubs)
    request = request_for(states["B"], "malformed")
    breaks(request)
    with pytest.raises(grpc.RpcError) as refused:
        stubs.updates.UpdateWeightsFromIpc(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(refused.value).reason == reason
    assert any(field in v.field or field in v.description for v in violations(refused.value)), case
    assert_unchanged(stubs, weights_server, before, tokens_a)


def test_client_refuses_names_the_model_does_not_have(
    client: TrainerClient, stubs: Stubs, weights_server: ServeProcess, tokens_a: list[int]
) -> None:
    import torch

    before = snapshot(stubs)
    with pytest.raises(InvalidArgumentError) as refused:
        client.update_weights_from_ipc({"model.bogus.weight": torch.zeros(4)}, "bogus")
    assert refused.value.reason == Reason.TENSOR_MISMATCH
    assert_unchanged(stubs, weights_server, before, tokens_a)


# --- handles no worker can map ------------------------------------------------------------------


def _segment_size(name: str) -> int:
    return os.stat(f"/dev/shm{name}").st_size


@pytest.mark.parametrize("how", ["vanished segment", "segment smaller than its handle"])
def test_unmappable_handle_fails_before_any_weight_is_written(
    how: str,
    client: TrainerClient,
    stubs: Stubs,
    weights_server: ServeProcess,
    states: dict[str, dict[str, Any]],
    tokens_a: list[int],
    tokens_b: list[int],
) -> None:
    # A fresh declaration: its full fingerprint baseline is still being taken in slices when
    # the failing update starts (an update does not wait for it). The update fails before
    # writing, so that baseline must complete and still describe the weights.
    client.update_weights_from_ipc(states["A"], "fresh-a")
    before = stubs.version()
    request = request_for(states["B"], "unmappable")
    # The last handle only: every tensor before it maps fine, yet none may be written.
    memory = request.handles[len(request.handles) - 1].shared_memory
    size = _segment_size(memory.segment_name)
    if how == "vanished segment":
        memory.segment_name = f"/torch_{os.getpid()}_{uuid.uuid4().int % 10**12}_0"
    else:
        memory.storage_nbytes += 4096
    done = stubs.wait(stubs.updates.UpdateWeightsFromIpc(request, timeout=60))
    code, info, metadata = operation_error(done)
    assert (code, info.reason) == (grpc.StatusCode.FAILED_PRECONDITION.value[0], Reason.IPC_HANDLE_UNAVAILABLE)
    assert not metadata.weights_modified and metadata.tensors_done == 0
    after = stubs.version()
    assert (after.declared, after.version, after.etag) == (True, before.version, before.etag)
    assert not after.HasField("last_failure")
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH
    if how != "vanished segment":  # the worker never grew the trainer's segment
        assert _segment_size(memory.segment_name) == size
    assert not engine_mappings(weights_server) & segments(states["B"])
    # Still serving, and still loading: the same tensors with good handles.
    client.update_weights_from_ipc(states["B"], "after-unmappable")
    assert greedy_tokens(weights_server) == tokens_b


# --- CUDA ----------------------------------------------------------------------------------------


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="CUDA IPC needs a CUDA device, and this machine has none")
def test_cuda_tensors_by_reference(
    client: TrainerClient,
    weights_server: ServeProcess,
    states: dict[str, dict[str, Any]],
    tokens_b: list[int],
) -> None:
    on_gpu = {name: t.cuda() for name, t in states["B"].items()}
    result = client.update_weights_from_ipc(on_gpu, "cuda-B")
    assert result.weight_version.source == WeightSource.IPC
    assert greedy_tokens(weights_server) == tokens_b
    assert client.verify_weights(full=True).verdict == "MATCH"


# --- where the RPC is listed ------------------------------------------------------------------------


def test_server_info_offers_ipc(stubs: Stubs) -> None:
    info = stubs.updates.GetServerInfo(upb.GetServerInfoRequest(), timeout=60)
    assert "enginectl.weights.v1.WeightUpdateService/UpdateWeightsFromIpc" in info.supported_rpcs
    assert upb.UPDATE_BACKEND_IPC in info.backends
