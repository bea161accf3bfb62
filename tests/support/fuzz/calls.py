"""The calls tests/e2e/test_fuzz.py makes: which services and RPCs there are (from the generated
modules' descriptors), and `FuzzCalls`, which sends fuzzed requests and checks each error
against the error contract (google.rpc.Status with one ErrorInfo of a stable reason, no
UNKNOWN or INTERNAL, no traceback, within the trailers' budget)."""

from __future__ import annotations

import base64
import importlib
import pkgutil
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
from google.longrunning import operations_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from enginectl.client.errors import DOMAIN, Reason
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from support.fuzz.requests import CANCEL, serialize, until_cancel
from support.fuzz.strategies import (
    NEVER_ACCEPTED_S,
    OPERATION_BUDGET_S,
    STREAM_MAX_MESSAGES,
    STREAM_WINDOW_S,
    TRAILER_BUDGET,
    UNARY_DEADLINE_S,
)
from support.serving import ServeProcess

# --- what is fuzzed ---------------------------------------------------------------------

# Packages whose generated `*_pb2` modules define the services (a new module is found),
# plus google.longrunning, whose Operations service the server implements.
SERVICE_PACKAGES = ("enginectl.weights.v1", "enginectl.fpm.v1")
EXTRA_SERVICE_MODULES = (operations_pb2,)


def _service_modules() -> list[ModuleType]:
    modules: list[ModuleType] = list(EXTRA_SERVICE_MODULES)
    for package_name in SERVICE_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.endswith("_pb2"):
                modules.append(importlib.import_module(f"{package_name}.{info.name}"))
    return modules


def _services() -> list[_descriptor.ServiceDescriptor]:
    found: dict[str, _descriptor.ServiceDescriptor] = {}
    for module in _service_modules():
        for service in module.DESCRIPTOR.services_by_name.values():
            found[service.full_name] = service
    return [found[name] for name in sorted(found)]


SERVICES = _services()
METHODS = [method for service in SERVICES for method in service.methods]


def rpc_name(method: _descriptor.MethodDescriptor) -> str:
    """The RPC as GetServerInfo.supported_rpcs names it: "package.Service/Method"."""
    return f"{method.containing_service.full_name}/{method.name}"


# --- the error contract ---------------------------------------------------------------

UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")
KNOWN_REASONS = {value for name, value in vars(Reason).items() if name.isupper()}


@dataclass
class Outcome:
    code: grpc.StatusCode
    response: Any = None
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    message: str = ""
    client_side: bool = False  # the client's own deadline or cancellation


@dataclass
class FuzzCalls:
    """The fuzzer's connection to its server: direct reads around every fuzzed call, and the
    fuzzed calls themselves, each turned into an Outcome once its error passed the error
    contract. The fields are the Fuzzer's (checker.py), which adds strategies and checks."""

    server: ServeProcess
    paths: list[str]
    good_paths: list[str]
    dead_port: int
    tensors: dict[str, tuple[str, list[int], bytes]]
    channel: grpc.Channel = field(init=False)
    version: wv.WeightVersion = field(init=False)
    seen_etags: list[str] = field(default_factory=list)
    seen_request_ids: list[str] = field(default_factory=list)
    operation_names: list[str] = field(default_factory=list)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(
            self.server.grpc_target,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                # Receive oversize trailers anyway, to measure them (TRAILER_BUDGET) rather than
                # depend on gRPC's randomised rejection between its soft and hard limits.
                ("grpc.max_metadata_size", 1 << 20),
                ("grpc.absolute_max_metadata_size", 1 << 20),
            ],
        )
        self.version = self.get_version()
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.limits = self._unary(
            "/enginectl.weights.v1.WeightUpdateService/GetServerInfo",
            upb.GetServerInfoRequest(),
            upb.GetServerInfoResponse,
        ).limits
        assert self.limits.max_timeout.seconds < NEVER_ACCEPTED_S, self.limits

    def close(self) -> None:
        self.channel.close()

    # --- direct reads, used around every fuzzed call ---

    def _unary(self, method: str, request: Message, response_cls: type[Message], timeout: float = 10.0) -> Any:
        call = self.channel.unary_unary(
            method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_cls.FromString
        )
        return call(request, timeout=timeout)

    def get_version(self) -> wv.WeightVersion:
        response = self._unary(
            "/enginectl.weights.v1.WeightVersionService/GetWeightVersion",
            vpb.GetWeightVersionRequest(),
            vpb.GetWeightVersionResponse,
        )
        return response.weight_version

    def health(self) -> int:
        return self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status

    def generation_state(self) -> upb.GenerationState:
        return self._unary(
            "/enginectl.weights.v1.WeightUpdateService/GetGenerationState",
            upb.GetGenerationStateRequest(),
            upb.GetGenerationStateResponse,
        ).state

    def resume(self) -> None:
        self._unary(
            "/enginectl.weights.v1.WeightUpdateService/ResumeGeneration",
            upb.ResumeGenerationRequest(force=True),
            upb.ResumeGenerationResponse,
        )

    def newest_operation(self) -> str:
        listed = self._unary(
            "/google.longrunning.Operations/ListOperations",
            operations_pb2.ListOperationsRequest(page_size=1),
            operations_pb2.ListOperationsResponse,
        )
        return listed.operations[0].name if listed.operations else ""

    def wait_operation(self, name: str) -> operations_pb2.Operation:
        give_up = time.monotonic() + OPERATION_BUDGET_S
        while True:
            op = self._unary(
                "/google.longrunning.Operations/WaitOperation",
                operations_pb2.WaitOperationRequest(name=name),
                operations_pb2.Operation,
                timeout=5.0,
            )
            if op.done:
                return op
            assert time.monotonic() < give_up, f"{name} did not end within {OPERATION_BUDGET_S}s: {op}"

    # --- calling ---

    def call(self, method: _descriptor.MethodDescriptor, request: Any) -> Outcome:
        path = f"/{rpc_name(method)}"
        output = GetMessageClass(method.output_type)
        kwargs: dict[str, Any] = {"request_serializer": serialize, "response_deserializer": output.FromString}
        if method.client_streaming and method.server_streaming:
            raise NotImplementedError("no bidirectional RPC to fuzz yet")
        if method.server_streaming:
            return self._read_stream(self.channel.unary_stream(path, **kwargs), request)
        if method.client_streaming:
            invoke = self.channel.stream_unary(path, **kwargs)
            return self._unary_outcome(
                lambda: invoke(until_cancel(request), timeout=UNARY_DEADLINE_S),
                gave_up=any(m is CANCEL for m in request),
            )
        invoke_unary = self.channel.unary_unary(path, **kwargs)
        return self._unary_outcome(lambda: invoke_unary(request, timeout=UNARY_DEADLINE_S))

    def _unary_outcome(self, invoke: Callable[[], Any], gave_up: bool = False) -> Outcome:
        try:
            return Outcome(grpc.StatusCode.OK, invoke())
        except grpc.RpcError as err:
            if gave_up and err.details() == "Exception iterating requests!":  # type: ignore[attr-defined]
                # The client abandoned the stream (gRPC reports it as UNKNOWN, client side).
                return Outcome(grpc.StatusCode.CANCELLED, message="the client gave up", client_side=True)
            return self._error(err)

    def _read_stream(self, invoke: Any, request: Message) -> Outcome:
        call = invoke(request, timeout=STREAM_WINDOW_S)
        received: list[Any] = []
        try:
            for message in call:
                received.append(message)
                if len(received) >= STREAM_MAX_MESSAGES:
                    call.cancel()
                    break
        except grpc.RpcError as err:
            outcome = self._error(err)
            outcome.response = received
            return outcome
        return Outcome(
            grpc.StatusCode.CANCELLED if len(received) >= STREAM_MAX_MESSAGES else grpc.StatusCode.OK,
            received,
            client_side=len(received) >= STREAM_MAX_MESSAGES,
        )

    def _error(self, err: grpc.RpcError) -> Outcome:
        code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        message: str = err.details() or ""  # type: ignore[attr-defined]
        assert not (code is grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size" in message), (
            f"the error did not fit in gRPC's trailers ({message!r}): a status must stay well under the "
            "8 KiB metadata limit, whatever the request held"
        )
        try:
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
        except ValueError as exc:
            raise AssertionError(f"{code.name}: inconsistent google.rpc.Status ({exc}); {message[:200]!r}") from None
        if status is None:
            # Only the client's own deadline or cancellation carries no status details.
            assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), (
                f"{code.name} without a google.rpc.Status: {message!r}"
            )
            return Outcome(code, message=message, client_side=True)
        info = self.check_status(status, code)
        size = _trailer_bytes(status)
        assert size <= TRAILER_BUDGET, (
            f"{code.name} {info.reason}: the status takes {size} bytes of trailers; a default gRPC client "
            f"refuses metadata over 8 KiB (at random from 8 to 16 KiB), so it must stay under {TRAILER_BUDGET} "
            f"whatever the request held — {message[:200]!r}"
        )
        return Outcome(code, reason=info.reason, metadata=dict(info.metadata), message=message)

    @staticmethod
    def check_status(status: status_pb2.Status, code: grpc.StatusCode | None = None) -> error_details_pb2.ErrorInfo:
        """The ErrorInfo of an error status, after checking the status against the contract."""
        name = code or next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
        where = f"{name.name} {status.message!r}"
        assert name is not grpc.StatusCode.UNKNOWN, f"UNKNOWN status: {where}"
        # INTERNAL too: an Operation's LOAD_FAILED is for loads that fail for real, never for
        # a request validation let through (weight_update_service.proto rule 1).
        assert name is not grpc.StatusCode.INTERNAL, f"INTERNAL status: {where}"
        assert not TRACEBACK.search(status.message), f"a traceback in the status message: {where}"
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        assert len(infos) == 1, f"{len(infos)} ErrorInfo details (one expected): {where}"
        info = error_details_pb2.ErrorInfo()
        infos[0].Unpack(info)
        assert info.domain == DOMAIN, f"ErrorInfo.domain {info.domain!r}: {where}"
        assert UPPER_SNAKE.match(info.reason), f"ErrorInfo.reason {info.reason!r} is not UPPER_SNAKE: {where}"
        assert info.reason in KNOWN_REASONS, f"ErrorInfo.reason {info.reason!r} is not a stable Reason: {where}"
        return info


def _trailer_bytes(status: status_pb2.Status) -> int:
    """Wire size of the grpc-message (percent-encoded) and grpc-status-details-bin (base64)
    trailers that carry `status`."""
    message = sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in status.message.encode())
    return message + len(base64.b64encode(status.SerializeToString()))
