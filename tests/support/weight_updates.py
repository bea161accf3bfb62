"""Blocking stubs with load/wait/verify helpers (`Stubs`), and the ErrorInfo of a refused call
(`error_info`), for the tests that update a real server's weights.

The fixtures built on them are in the conftest.py files: `stubs` (module: `Stubs` on the
session's `weights_server`) in tests/e2e/conftest.py; `tokens_a`, `tokens_b` and the autouse
`back_to_a` of the modules in tests/e2e/weight_updates/ in that folder's conftest.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from google.longrunning import operations_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from support.weights import WeightStubs


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
