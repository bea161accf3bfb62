"""Shared by the test_weight_update*.py modules: blocking stubs with load/wait/verify helpers,
the ErrorInfo of a refused call, and the module fixtures every one of them uses (import them:
`from weight_update_fixtures import back_to_a, stubs, tokens_a, ...`). `checkpoints` and
`weights_server` come from conftest.py: importing them too would start a server per module.

- `stubs` (module): `Stubs` on the session's `weights_server`.
- `tokens_a` (module): loads checkpoint A (declared "A") and reads its greedy tokens.
- `tokens_b` (module): B's greedy tokens (different from A's), back on A afterwards.
- `back_to_a` (autouse): after each test, generation resumed (forced) and A loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.longrunning import operations_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from support.serving import ServeProcess
from support.weights import Checkpoints, WeightStubs, greedy_tokens


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
