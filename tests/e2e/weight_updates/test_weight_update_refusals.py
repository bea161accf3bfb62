"""Weight updates refused before anything is touched, on a real engine: bad paths, formats,
tensors, versions, pause modes, etags and groups, and a second update while one holds the update
slot (cancelled: nothing changes).

Every test leaves the session's `weights_server` (tests/e2e/conftest.py) serving checkpoint A,
resumed (fixture `back_to_a`). Tokens are greedy token ids from vLLM's HTTP API.
"""

from __future__ import annotations

import pickle
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from support.serving import ServeProcess
from support.weight_updates import Stubs, error_info
from support.weights import Checkpoints, greedy_tokens

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

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
