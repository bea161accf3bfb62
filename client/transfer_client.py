"""WeightSyncClient: vLLM's four-step weight-sync client, over enginectl's gRPC.

Runs in the trainer process. It has the methods of vLLM's `VLLMWeightSyncClient` protocol
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`, and `shutdown_weight_transfer_engine`), so any trainer-side engine of
vLLM's `WeightTransferTrainerFactory` drives an `enginectl serve` through it, and each round
is an enginectl update: a version recorded only on success, fencing, a request id, the pause
mode, deadlines, the partial rule (docs/weights.md, "vLLM's weight-transfer engines"). Its
methods are blocking and thread-safe (a trainer engine runs `update_weights` on a thread
beside its broadcast); errors are EnginectlErrors carrying the server's reason.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import grpc
from google.protobuf import duration_pb2, json_format, struct_pb2

from enginectl.client.client import ChannelConfig
from enginectl.client.errors import from_rpc_error
from enginectl.client.trainer_requests import PAUSE_MODES
from enginectl.client.trainer_types import UpdateOperation, UpdateResult
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

GRACE_S = 30.0  # past a round's own timeout, for the finish's answer


class WeightSyncClient:
    """One server's four steps. Per round: `pause_mode`, `timeout` (the whole round) and
    `step_timeout` (the longest wait for the trainer's next step); `etag` fences the round's
    start and finish (`finish_weight_update(version, etag=...)` overrides it). With
    `stage_only` a round stages instead (docs/weights.md, "Two-phase updates"): nothing is
    paused or applied, and `last_result.staged` names the set `commit_staged_weights` applies.
    After a round, `last_result` is its UpdateResult."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        pause_mode: str = "keep",
        timeout: float | None = None,
        step_timeout: float | None = None,
        etag: str | None = None,
        request_id: str | None = None,
        stage_only: bool = False,
        rpc_timeout: float = 120.0,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {sorted(PAUSE_MODES)}, not {pause_mode!r}")
        self._config = ChannelConfig(target=target, token=token, timeout=rpc_timeout)
        self._channel = self._config.channel()
        self._stub = pb2_grpc.WeightUpdateServiceStub(self._channel)
        self.pause_mode, self.timeout, self.step_timeout = pause_mode, timeout, step_timeout
        self.etag, self.request_id, self.stage_only = etag, request_id, stage_only
        self.operation = ""  # the open round's Operation
        self.last_result: UpdateResult | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self._config.timeout, metadata=self._config.metadata())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = struct_pb2.Struct()
        info.update(init_info)
        self._call(self._stub.InitWeightTransferEngine, pb2.InitWeightTransferEngineRequest(init_info=info))

    def start_weight_update(self) -> None:
        request = pb2.StartWeightUpdateRequest(
            etag=self.etag or "",
            request_id=self.request_id or "",
            pause_mode=PAUSE_MODES[self.pause_mode],
            stage_only=self.stage_only,
        )
        if self.timeout is not None:
            request.timeout.CopyFrom(_duration(self.timeout))
        if self.step_timeout is not None:
            request.step_timeout.CopyFrom(_duration(self.step_timeout))
        op = self._call(self._stub.StartWeightUpdate, request)
        with self._lock:
            self.operation = op.name

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        value = struct_pb2.Value()
        json_format.ParseDict(cast(Any, update_info), value)
        self._call(self._stub.UpdateWeights, pb2.UpdateWeightsRequest(name=self.operation, update_info=value))

    def finish_weight_update(self, weight_version: str | None = None, *, etag: str | None = None) -> None:
        request = pb2.FinishWeightUpdateRequest(name=self.operation, etag=etag if etag is not None else self.etag or "")
        if weight_version is not None:
            request.weight_version = weight_version
        bound = (self.timeout or self._config.timeout) + GRACE_S
        op = UpdateOperation.from_proto(self._call(self._stub.FinishWeightUpdate, request, bound))
        self.last_result = op.result()  # raises the round's error

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self._stub.ShutdownWeightTransferEngine, pb2.ShutdownWeightTransferEngineRequest())


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value
