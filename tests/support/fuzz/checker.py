"""The fuzzer of tests/e2e/test_fuzz.py: the requests it draws for each RPC (from the message
builder, the model's own tensors and stream chunks) and what it checks after every call: the
error contract (calls.py), the WeightVersion resource and generation state as the rules
of weight_update_service.proto say, and a few promises about single fields
(`_postconditions`, `_check_resource`)."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

import grpc
from google.longrunning import operations_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import duration_pb2, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from enginectl.client.errors import Reason
from enginectl.server.interceptors import is_read_only
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from support.fuzz.calls import FuzzCalls, Outcome, rpc_name
from support.fuzz.fodder import DTYPE_CODES
from support.fuzz.requests import (
    CANCEL,
    HINTS,
    MASTER_ADDRESSES,
    REQUIRED_PRESENT,
    MessageBuilder,
    RawRequest,
    find_string_field,
    parse_request,
    raw_requests,
)
from support.fuzz.strategies import (
    INT32,
    INT64,
    MAX_FUZZ_TIMEOUT_NS,
    NEVER_ACCEPTED_S,
    UINT64,
    UNARY_DEADLINE_S,
    edge_ints,
    weighted,
)


class Fuzzer(FuzzCalls):
    """Sends fuzzed requests and checks every outcome against the error contract."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.builder = MessageBuilder(self, HINTS)
        self.tensor_names = sorted(self.tensors)
        # Small tensors (norm weights, 512 bytes) carry the coherent streams: their own values.
        self.small = sorted(k for k, (_, shape, _) in self.tensors.items() if len(shape) == 1)
        self._too_many: list[Message] | None = None

    def harmless(self, message: Message) -> bool:
        """Within the bounds every fuzzed request keeps: each Duration at most 2 s or one no
        RPC accepts, REQUIRED_PRESENT fields set, master_address/master_port as hinted."""
        for f in message.DESCRIPTOR.fields:
            if f.full_name in REQUIRED_PRESENT and not message.HasField(f.name):
                return False
            if f.name == "master_address" and getattr(message, f.name) not in MASTER_ADDRESSES:
                return False
            if f.name == "master_port" and getattr(message, f.name) not in (0, self.dead_port, 65536, 2**32 - 1):
                return False
            if f.type != FieldDescriptor.TYPE_MESSAGE:
                continue
            values = (
                list(getattr(message, f.name))
                if f.is_repeated
                else ([getattr(message, f.name)] if message.HasField(f.name) else [])
            )
            for value in values:
                if f.message_type.full_name == "google.protobuf.Duration":
                    nanos = value.seconds * 10**9 + value.nanos
                    if MAX_FUZZ_TIMEOUT_NS < nanos < NEVER_ACCEPTED_S * 10**9:
                        return False
                elif not self.harmless(value):
                    return False
        return True

    # --- strategies ---

    def request(self, method: _descriptor.MethodDescriptor) -> st.SearchStrategy[Any]:
        if method.client_streaming:
            return self.stream_of(method.input_type)
        message = self.builder.message(method.input_type)
        return weighted((7, message), (1, raw_requests(message, method.input_type, self)))

    def tensor_lists(self) -> st.SearchStrategy[list[Message]]:
        """TensorSpec lists: the model's own tensors (right or wrong dtype/shape), duplicates,
        or one past ServerLimits.max_tensors_per_update."""

        def spec(name: str, dtype: int | None = None, shape: list[int] | None = None) -> upb.TensorSpec:
            code, real_shape, _ = self.tensors.get(name, ("F32", [1], b""))
            return upb.TensorSpec(
                name=name,
                dtype=DTYPE_CODES[code] if dtype is None else dtype,
                shape=real_shape if shape is None else shape,
            )

        real = st.lists(st.sampled_from(self.tensor_names), min_size=1, max_size=4).map(
            lambda ns: [spec(n) for n in ns]
        )
        odd = st.tuples(
            st.sampled_from(self.tensor_names), edge_ints(*INT32), st.lists(edge_ints(*INT64), max_size=9)
        ).map(lambda t: [spec(t[0], t[1], t[2])])
        huge = st.just(None).map(lambda _: self.too_many_tensors())
        # Another model's checkpoint: every name unknown, each refusal listed (BadRequest).
        foreign = st.integers(90, 300).map(
            lambda n: [spec(f"model.layers.{i}.mlp.experts.{i % 64}.down_proj.weight_scale_inv") for i in range(n)]
        )
        return weighted((2, real), (1, odd), (1, huge), (1, foreign), (1, st.just([])))

    def too_many_tensors(self) -> list[Message]:
        """One TensorSpec past GetServerInfo's limits.max_tensors_per_update (parsed from
        bytes once: building a quarter million messages in Python takes seconds here)."""
        if self._too_many is None:
            spec = upb.TensorSpec(name="t", dtype=upb.TENSOR_DTYPE_FLOAT32, shape=[1]).SerializeToString()
            count = self.limits.max_tensors_per_update + 1
            header = upb.TensorStreamHeader.FromString((b"\x0a" + bytes([len(spec)]) + spec) * count)
            self._too_many = list(header.tensors)
        return self._too_many

    def stream_of(self, descriptor: _descriptor.Descriptor) -> st.SearchStrategy[list[Message]]:
        """Client-stream message sequences: anything (headers in wrong places, empty or
        mis-ordered chunks, nothing at all), or a coherent header + chunks of the model's
        own bytes, cut short, padded, reordered or interrupted."""
        message = self.builder.message(descriptor)
        generic = st.lists(weighted((3, message), (1, raw_requests(message, descriptor, self))), max_size=5)

        @st.composite
        def coherent(draw: st.DrawFn) -> list[Message]:
            names = draw(st.lists(st.sampled_from(self.small), min_size=1, max_size=3, unique=True))
            header = draw(self.builder.message(upb.TensorStreamHeader.DESCRIPTOR))
            del header.tensors[:]
            header.tensors.extend(
                upb.TensorSpec(name=n, dtype=DTYPE_CODES[self.tensors[n][0]], shape=self.tensors[n][1]) for n in names
            )
            if draw(st.booleans()):  # else the fuzzed one: absent, 1 ns .. 2 s, or refused
                header.timeout.CopyFrom(duration_pb2.Duration(seconds=2))
            data = b"".join(self.tensors[n][2] for n in names)
            cuts = sorted(set(draw(st.lists(st.integers(1, len(data) - 1), max_size=4))))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
            chunks = []
            offset = 0
            for piece in pieces:
                chunks.append(
                    upb.UpdateWeightsFromTensorsRequest(chunk=upb.TensorStreamChunk(offset=offset, data=piece))
                )
                offset += len(piece)
            mutation = draw(
                st.sampled_from(
                    [
                        "none",
                        "none",
                        "drop_last",
                        "drop_first",
                        "duplicate",
                        "swap",
                        "extra_byte",
                        "empty_chunk",
                        "second_header",
                        "bad_offset",
                        "oversize",
                        "cancel",
                    ]
                )
            )
            if mutation == "drop_last":
                chunks.pop()
            elif mutation == "drop_first" and len(chunks) > 1:
                chunks.pop(0)
            elif mutation == "duplicate":
                chunks.insert(draw(st.integers(0, len(chunks))), chunks[draw(st.integers(0, len(chunks) - 1))])
            elif mutation == "swap" and len(chunks) > 1:
                chunks[0], chunks[1] = chunks[1], chunks[0]
            elif mutation == "extra_byte":
                chunks.append(
                    upb.UpdateWeightsFromTensorsRequest(chunk=upb.TensorStreamChunk(offset=len(data), data=b"\x00"))
                )
            elif mutation == "empty_chunk":
                chunks.insert(
                    draw(st.integers(0, len(chunks))),
                    upb.UpdateWeightsFromTensorsRequest(chunk=upb.TensorStreamChunk(offset=0)),
                )
            elif mutation == "second_header":
                chunks.insert(draw(st.integers(0, len(chunks))), upb.UpdateWeightsFromTensorsRequest(header=header))
            elif mutation == "bad_offset":
                chunks[-1].chunk.offset = draw(edge_ints(*UINT64))
            elif mutation == "cancel":  # the client gives up part-way
                chunks.insert(draw(st.integers(0, len(chunks))), CANCEL)
            elif mutation == "oversize":
                chunks.insert(
                    0,
                    upb.UpdateWeightsFromTensorsRequest(
                        chunk=upb.TensorStreamChunk(offset=0, data=b"\x00" * (4 * 1024 * 1024 + 1))
                    ),
                )
            return [upb.UpdateWeightsFromTensorsRequest(header=header), *chunks]

        if descriptor.full_name == upb.UpdateWeightsFromTensorsRequest.DESCRIPTOR.full_name:
            return weighted((2, coherent()), (1, generic))
        return generic

    # --- checking ---

    def check(self, method: _descriptor.MethodDescriptor, request: Any) -> None:
        """One fuzzed call, checked; leaves the engine resumed with no update running, also
        when a check failed (so one finding does not fail every later example too)."""
        try:
            self._check(method, request)
        except BaseException:
            with contextlib.suppress(Exception):  # the finding above is what to report
                self._settle()
            raise
        self._settle()

    def _check(self, method: _descriptor.MethodDescriptor, request: Any) -> None:
        self._settle()  # a pause may land late (a WAIT pause that timed out): start running
        before, health_before = self.get_version(), self.health()
        # An RPC that starts a long-running operation says so (AIP-151: operation_info).
        starts_operation = method.GetOptions().HasExtension(operations_pb2.operation_info)
        newest_before = self.newest_operation() if starts_operation else ""
        started = time.monotonic()
        outcome = self.call(method, request)
        elapsed = time.monotonic() - started
        self.counts[(method.name, "client " + outcome.code.name if outcome.client_side else outcome.code.name)] += 1
        described = f"{rpc_name(method)} -> {outcome.code.name} {outcome.reason} {outcome.message[:500]!r}"
        if outcome.client_side and outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            assert method.server_streaming, (
                f"no answer within {UNARY_DEADLINE_S}s ({elapsed:.1f}s): every wait of a unary RPC is bounded by "
                f"its request (at most 2 s here) — {described}"
            )
        for message in (m for m in (request if isinstance(request, list) else [request]) if isinstance(m, Message)):
            for rid_field in ("request_id",):
                rid = find_string_field(message, rid_field)
                if rid:
                    self.seen_request_ids.append(rid)
        # The Operation this call started, if any: returned, or (a call that failed after its
        # Operation began, e.g. a stream the client gave up) the newest one, if new. A retried
        # request_id is answered with its first Operation (or that Operation's error): a
        # replay, which changes nothing.
        known = set(self.operation_names)
        operation = outcome.response if starts_operation and outcome.code is grpc.StatusCode.OK else None
        name = operation.name if operation is not None else ""
        if not name and starts_operation:
            name = self.newest_operation()
            name = "" if name == newest_before else name
        replayed = name in known or outcome.metadata.get("operation", "") in known
        op_failed, op_succeeded = "", False
        if name:
            self.operation_names.append(name)
            operation = self.wait_operation(name)
            if operation.HasField("error"):
                op_failed = self.check_status(operation.error).reason
            op_succeeded = not op_failed
        after, health_after = self.get_version(), self.health()
        partial = Reason.PARTIAL_UPDATE in (outcome.reason, op_failed) and not replayed
        # A partial update quarantines the server (NOT_SERVING until a success or a forced
        # resume); nothing else changes health.
        want_health = health_pb2.HealthCheckResponse.NOT_SERVING if partial else health_before
        assert health_after == want_health, f"health {health_before} -> {health_after}: {described}"
        refused = (outcome.code is not grpc.StatusCode.OK and not outcome.client_side) or bool(op_failed)
        if partial:
            # Rule 6: failed after writing began: undeclared, with last_failure; paused.
            assert not after.declared and after.last_failure.reason == Reason.PARTIAL_UPDATE, f"{described}: {after}"
            assert after.revision == before.revision, f"{described}: revision {before.revision} -> {after.revision}"
        elif (
            replayed
            or refused
            or (outcome.client_side and not op_succeeded)
            or (is_read_only(f"/{rpc_name(method)}") and outcome.code is grpc.StatusCode.OK)
        ):
            assert after == before, (
                f"{described}{' (operation: ' + op_failed + ')' if op_failed else ''} changed the WeightVersion:\n"
                f"before {text_format.MessageToString(before, as_one_line=True)}\n"
                f"after  {text_format.MessageToString(after, as_one_line=True)}"
            )
        _check_resource(after, described)
        if op_succeeded and not replayed:
            # Rule 5: the response carries the resource as the update left it.
            response = upb.UpdateWeightsResponse()
            assert operation is not None and operation.response.Unpack(response), operation
            assert response.weight_version == after, f"{described}: {response.weight_version} then {after}"
        # Generation ran before the call (see _settle). Only a successful PauseGeneration, or
        # an update that failed after writing began (rule 6), leaves it paused; a refusal,
        # a clean failure and a success of anything else leave it running (rule 3).
        paused_now = self.generation_state()
        want_paused = partial or (method.name == "PauseGeneration" and outcome.code is grpc.StatusCode.OK)
        assert paused_now.paused == want_paused, f"{described}: generation state afterwards {paused_now}"
        if partial:
            assert paused_now.reason == upb.PAUSE_REASON_PARTIAL_UPDATE, f"{described}: {paused_now}"
        parsed = parse_request(method, request)
        if parsed is not None:
            self._postconditions(method, parsed, outcome, after)
        elif isinstance(request, RawRequest):
            assert (outcome.code, outcome.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.MALFORMED_REQUEST), (
                f"bytes that do not parse: {described}"
            )
        if after.etag != before.etag:
            self.seen_etags.append(before.etag)

    def _postconditions(
        self, method: _descriptor.MethodDescriptor, request: Any, outcome: Outcome, after: wv.WeightVersion
    ) -> None:
        """What the protos promise about a few fuzzed requests, beyond the error contract."""
        name = method.name
        if outcome.reason == Reason.ETAG_MISMATCH and name == "SetWeightVersion":
            # SetWeightVersion ETAG_MISMATCH: metadata "current_etag", "current_revision" and
            # "incarnation" describe the resource now.
            want = {
                "current_etag": after.etag,
                "current_revision": str(after.revision),
                "incarnation": after.incarnation,
            }
            got = {k: outcome.metadata.get(k) for k in want}
            assert got == want, f"ETAG_MISMATCH metadata {outcome.metadata}, expected {want}"
        if outcome.code is grpc.StatusCode.OUT_OF_RANGE and name == "WatchWeightVersion":
            # "Every OUT_OF_RANGE error carries metadata["incarnation"], the current one."
            assert outcome.metadata.get("incarnation") == after.incarnation, outcome.metadata
        if outcome.code is grpc.StatusCode.OK and name == "SetWeightVersion":
            assert outcome.response.weight_version.version == request.version, outcome.response
        if outcome.code is grpc.StatusCode.OK and name == "PauseGeneration":
            # PauseGenerationRequest.mode: "Unset (UNSPECIFIED) means KEEP".
            want = request.mode or upb.PAUSE_MODE_KEEP
            assert outcome.response.state.paused and outcome.response.state.mode == want, (
                f"PauseGeneration(mode={request.mode}) paused with mode {outcome.response.state.mode}, expected {want}"
            )
        if name == "InitWeightsUpdateGroup" and request.world_size > 65536 and not outcome.client_side:
            # InitWeightsUpdateGroupRequest.world_size: "at most 65536" (GROUP_SIZE_INVALID).
            assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, (
                f"world_size {request.world_size} answered {outcome.code.name} {outcome.reason}"
            )

    def _settle(self) -> None:
        """Undo a fuzzed pause, so the next call (and the final generation) starts running."""
        state = self.generation_state()
        if state.update_operation:
            self.wait_operation(state.update_operation)
            state = self.generation_state()
        if state.paused:
            self.resume()
            assert not self.generation_state().paused
        self.version = self.get_version()


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _check_resource(version: wv.WeightVersion, described: str) -> None:
    """WeightVersion.version: set iff declared; non-empty UTF-8, at most 256 bytes, without
    control characters (whatever declared it: SetWeightVersion or an update)."""
    assert version.declared == version.HasField("version"), f"{described}: {version}"
    if version.declared:
        assert 0 < len(version.version.encode()) <= 256, f"{described}: declared {version.version!r}"
        assert not CONTROL.search(version.version), f"{described}: declared {version.version!r} (a control character)"
