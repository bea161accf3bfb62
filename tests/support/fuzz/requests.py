"""Fuzzed requests for tests/e2e/test_fuzz.py, built from the protobuf descriptors: any message
(`MessageBuilder`), with hints that reach deeper into the server (`HINTS`) and valid requests
to mutate (`BASELINES`); raw bytes around a serialization (`RawRequest`); client streams the
client gives up part-way (`CANCEL`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.longrunning import operations_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import duration_pb2, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from enginectl.fpm.v1 import fpm_identity_service_pb2 as fpb
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from support.fuzz.strategies import (
    BYTES,
    INT32,
    INT64,
    SCALARS,
    STRINGS,
    durations,
    edge_ints,
    short_durations,
    weighted,
)

if TYPE_CHECKING:
    from support.fuzz.checker import Fuzzer

# --- requests from descriptors ------------------------------------------------------------

# A hint for a field: a strategy for its value (REPEATED hints give the whole list).
Hint = Callable[["Fuzzer"], st.SearchStrategy[Any]]


def _is_synthetic_oneof(oneof: _descriptor.OneofDescriptor) -> bool:
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


@dataclass
class MessageBuilder:
    """Builds any message from its descriptor: scalars with edge values, enums in and out of
    range, 0..N repeated items, nested messages, one member (or none) of each oneof, and
    Duration/Timestamp with out-of-range values. `hints` (by field name or full name) mix
    values that reach deeper into the server with the generic ones."""

    fuzzer: Fuzzer
    hints: dict[str, Hint]
    max_depth: int = 3
    max_items: int = 4

    def message(self, descriptor: _descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        cls = GetMessageClass(descriptor)
        if descriptor.full_name == "google.protobuf.Duration":
            return durations()
        if descriptor.full_name == "google.protobuf.Timestamp":
            return st.tuples(edge_ints(*INT64), edge_ints(*INT32)).map(lambda t: cls(seconds=t[0], nanos=t[1]))
        if descriptor.full_name == "google.protobuf.Any":
            return st.one_of(st.just(cls()), st.tuples(STRINGS, BYTES).map(lambda t: cls(type_url=t[0], value=t[1])))

        @st.composite
        def build(draw: st.DrawFn) -> Message:
            msg = cls()
            chosen: dict[str, str | None] = {}
            for oneof in descriptor.oneofs:
                if not _is_synthetic_oneof(oneof):
                    chosen[oneof.name] = draw(st.sampled_from([None, *[f.name for f in oneof.fields]]))
            for f in descriptor.fields:
                oneof = f.containing_oneof
                if oneof is not None and not _is_synthetic_oneof(oneof):
                    if chosen[oneof.name] != f.name:
                        continue
                elif f.has_presence and not self._required(f) and not draw(st.booleans()):
                    continue
                self._set(msg, f, draw(self.field(f, depth)))
            return msg

        if depth >= self.max_depth:
            return st.just(cls())
        baseline = BASELINES.get(descriptor.full_name)
        if baseline is None:
            return build()
        mutated = self._mutate(descriptor, baseline(self.fuzzer), depth)
        return weighted((2, mutated), (1, build()))  # simplest first: the valid request

    def _mutate(
        self, descriptor: _descriptor.Descriptor, valid: st.SearchStrategy[Message], depth: int
    ) -> st.SearchStrategy[Message]:
        """A valid request with up to two fields fuzzed (or cleared): reaches the checks that
        come after the first refusal a fully random request would hit."""

        @st.composite
        def mutate(draw: st.DrawFn) -> Message:
            msg = draw(valid)
            names = [f.name for f in descriptor.fields]
            for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)) if names else []:
                f = descriptor.fields_by_name[name]
                msg.ClearField(name)
                if f.has_presence and not self._required(f) and draw(st.booleans()):
                    continue
                self._set(msg, f, draw(self.field(f, depth)))
            return msg

        return mutate()

    def _required(self, f: FieldDescriptor) -> bool:
        return f.full_name in REQUIRED_PRESENT

    def field(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        generic = self._generic(f, depth)
        hint = self.hints.get(f.full_name) or self.hints.get(f.name)
        if hint is None:
            return generic
        if f.full_name in HINT_ONLY or f.name in HINT_ONLY:
            return hint(self.fuzzer)
        hinted = hint(self.fuzzer)
        return weighted((3, hinted), (1, generic))  # mostly hinted, sometimes anything

    def _generic(self, f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            item: st.SearchStrategy[Any] = self.message(f.message_type, depth + 1)
        elif f.type == FieldDescriptor.TYPE_ENUM:
            item = st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), edge_ints(*INT32))
        else:
            item = SCALARS[f.type]
        if f.is_repeated:
            return st.lists(item, max_size=self.max_items)
        return item

    @staticmethod
    def _set(msg: Message, f: FieldDescriptor, value: Any) -> None:
        if f.is_repeated:
            target = getattr(msg, f.name)
            if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
                return  # no request has a map field; leave it empty if one appears
            target.extend(value)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, f.name).CopyFrom(value)
        else:
            setattr(msg, f.name, value)


# Fields always present when fuzzed (an unset one means a long server default: a group
# rendezvous against a port nobody listens on would wait ServerLimits.default_timeout).
REQUIRED_PRESENT = {"enginectl.weights.v1.InitWeightsUpdateGroupRequest.timeout"}
# Fields only ever given hinted values (anything else could leave loopback).
HINT_ONLY = {"master_address", "master_port"}
# Loopback, or refused before any lookup (empty, over 253 bytes): nothing leaves the machine.
MASTER_ADDRESSES = ["127.0.0.1", "localhost", "::1", "", "h" * 254]


def _dynamic(values: Callable[[], Sequence[Any]], fallback: Any) -> st.SearchStrategy[Any]:
    """One of `values()` as they are when drawn (the server's state moves between calls).
    The draw itself never depends on that state (hypothesis replays draws and requires them
    to be the same): an index from a fixed range, taken modulo what there is."""

    @st.composite
    def pick(draw: st.DrawFn) -> Any:
        index = draw(st.integers(0, 2**16))
        current = list(values())
        return current[index % len(current)] if current else fallback

    return pick()


def _uuids() -> st.SearchStrategy[str]:
    return st.uuids().map(str)


HINTS: dict[str, Hint] = {
    "version": lambda fz: st.one_of(
        st.sampled_from(["initial", "default", "0", "step-1", "ü" * 128]),
        st.integers(0, 10**6).map(lambda n: f"fuzz-{n}"),
    ),
    "weight_version": lambda fz: st.one_of(
        st.sampled_from(["initial", "0", "ü" * 128]), st.integers(0, 10**6).map(lambda n: f"fuzz-{n}")
    ),
    "etag": lambda fz: st.one_of(
        st.just(""), _dynamic(lambda: [fz.version.etag], ""), _dynamic(lambda: fz.seen_etags, "")
    ),
    "request_id": lambda fz: st.one_of(
        st.just(""),
        _uuids(),
        _dynamic(lambda: fz.seen_request_ids, ""),
        _uuids().map(str.upper),
        _uuids().map(lambda u: "{" + u + "}"),
    ),
    "path": lambda fz: st.sampled_from(fz.paths),
    "group_name": lambda fz: st.sampled_from(
        ["g", "fuzz-group", "a.b_c-d", "x" * 128, "x" * 129, "with space", "ü", "a/b"]
    ),
    "master_address": lambda fz: st.sampled_from(MASTER_ADDRESSES),
    "master_port": lambda fz: st.sampled_from([0, fz.dead_port, 65536, 2**32 - 1]),
    "rank_offset": lambda fz: st.sampled_from([0, 1, 2, 65536, 2**32 - 1]),
    "world_size": lambda fz: st.sampled_from([0, 1, 2, 3, 65536, 65537, 2**31, 2**32 - 1]),
    "worker_id": lambda fz: st.one_of(
        st.sampled_from(["w", "worker-0", "ü" * 128, "ü" * 129, "a\x00b", "tab\there"]),
        st.integers(0, 99).map(lambda n: f"fuzz-worker-{n}"),
    ),
    # google.longrunning: names of operations of this incarnation, and near misses.
    "name": lambda fz: st.one_of(
        _dynamic(lambda: fz.operation_names, "operations/none"),
        _uuids().map(lambda u: f"operations/{u}"),
        st.sampled_from(["operations/", "operations", "operations/../x"]),
    ),
    "google.longrunning.ListOperationsRequest.filter": lambda fz: st.sampled_from(
        ["", "done=true", "done=false", "done=TRUE", "done = true"]
    ),
    "page_token": lambda fz: st.sampled_from(["", "0", "1", "2", "-1", "999999", "1e3", "٣", " 1", "x"]),
    "page_size": lambda fz: st.sampled_from([0, 1, 2, 100, 101, -1, 2**31 - 1]),
    "since_revision": lambda fz: st.one_of(
        _dynamic(lambda: [fz.version.revision, fz.version.revision + 1, max(fz.version.revision - 1, 0)], 0),
        st.sampled_from([0, 2**64 - 1]),
    ),
    "incarnation": lambda fz: st.one_of(
        _dynamic(lambda: [fz.version.incarnation], ""), st.sampled_from(["", "0" * 16, "i" * 10_000])
    ),
    "resume_incarnation": lambda fz: st.one_of(
        _dynamic(lambda: [fz.version.incarnation], ""), st.sampled_from(["", "0" * 16, "i" * 10_000])
    ),
    "resume_after_sequence": lambda fz: st.sampled_from([0, 1, 5, 10_000, 2**63, 2**64 - 1]),
    "max_batch_size": lambda fz: st.sampled_from([0, 1, 1000, 10_000, 10_001, 2**32 - 1]),
    "enginectl.weights.v1.TensorSpec.name": lambda fz: st.sampled_from(fz.tensor_names),
    "tensors": lambda fz: fz.tensor_lists(),
}


# Valid requests (for this server and the state it is in when drawn), mutated by
# MessageBuilder._mutate. Each reaches as far as a fuzzed request can go here: a group
# rendezvous that is refused at once, an update of the model's own values.
BASELINES: dict[str, Callable[[Fuzzer], st.SearchStrategy[Message]]] = {
    "enginectl.weights.v1.SetWeightVersionRequest": lambda fz: st.tuples(
        HINTS["version"](fz),
        st.one_of(st.just(""), _dynamic(lambda: [fz.version.etag], "")),
        st.one_of(st.just(""), _uuids()),
    ).map(lambda t: vpb.SetWeightVersionRequest(version=t[0], etag=t[1], request_id=t[2])),
    "enginectl.weights.v1.PauseGenerationRequest": lambda fz: st.tuples(
        st.sampled_from([0, 1, 2, 3]), st.booleans()
    ).map(
        lambda t: upb.PauseGenerationRequest(mode=t[0], clear_cache=t[1], wait_timeout=duration_pb2.Duration(seconds=1))
    ),
    "enginectl.weights.v1.InitWeightsUpdateGroupRequest": lambda fz: st.tuples(
        st.sampled_from(["g", "fuzz-group"]), st.sampled_from([1, 2]), st.integers(0, 3)
    ).map(
        lambda t: upb.InitWeightsUpdateGroupRequest(
            group_name=t[0],
            master_address="127.0.0.1",
            master_port=fz.dead_port,
            rank_offset=t[1],
            world_size=t[1] + 1 + t[2],
            backend=upb.GROUP_BACKEND_GLOO,
            timeout=duration_pb2.Duration(nanos=500_000_000),
        )
    ),
    "enginectl.weights.v1.UpdateWeightsFromDiskRequest": lambda fz: st.tuples(
        st.sampled_from(fz.good_paths),
        st.one_of(st.none(), HINTS["weight_version"](fz)),
        st.sampled_from([0, 1, 2, 3]),
        short_durations(),
    ).map(lambda t: _with_version(upb.UpdateWeightsFromDiskRequest(path=t[0], pause_mode=t[2], timeout=t[3]), t[1])),
    "enginectl.weights.v1.UpdateWeightsFromDistributedRequest": lambda fz: fz.tensor_lists().map(
        lambda tensors: upb.UpdateWeightsFromDistributedRequest(
            group_name="fuzz-group", tensors=tensors, timeout=duration_pb2.Duration(seconds=1)
        )
    ),
    "enginectl.fpm.v1.SetWorkerIdentityRequest": lambda fz: HINTS["worker_id"](fz).map(
        lambda w: fpb.SetWorkerIdentityRequest(worker_id=w, timeout=duration_pb2.Duration(seconds=2))
    ),
    "enginectl.weights.v1.WatchWeightVersionRequest": lambda fz: HINTS["since_revision"](fz).map(
        lambda r: vpb.WatchWeightVersionRequest(since_revision=r, incarnation=fz.version.incarnation)
    ),
    "google.longrunning.WaitOperationRequest": lambda fz: HINTS["name"](fz).map(
        lambda n: operations_pb2.WaitOperationRequest(name=n, timeout=duration_pb2.Duration(nanos=100_000_000))
    ),
}


def _with_version(request: Any, version: str | None) -> Any:
    if version is not None:
        request.weight_version = version
    return request


@dataclass(frozen=True)
class RawRequest:
    """Request bytes as sent: a truncated or extended serialization, or any bytes at all.
    A request that does not parse is INVALID_ARGUMENT MALFORMED_REQUEST (interceptors.py);
    one that does (unknown fields, a prefix) is an ordinary request."""

    data: bytes


def raw_requests(
    messages: st.SearchStrategy[Message], descriptor: _descriptor.Descriptor, fuzzer: Fuzzer
) -> st.SearchStrategy[RawRequest]:
    """Bytes around a serialization. What parses must keep the bounds the builder keeps (a
    cut can drop a required timeout, random bytes can spell a long one or another host)."""
    cut = st.tuples(messages, st.integers(0, 64), st.binary(max_size=8)).map(
        lambda t: RawRequest(t[0].SerializeToString()[: t[1]] + t[2])
    )
    cls = GetMessageClass(descriptor)

    def harmless(raw: RawRequest) -> bool:
        try:
            parsed = cls.FromString(raw.data)
        except Exception:  # noqa: BLE001 - does not parse: MALFORMED_REQUEST, harmless
            return True
        return fuzzer.harmless(parsed)

    return st.one_of(cut, st.binary(max_size=48).map(RawRequest)).filter(harmless)


def serialize(request: Message | RawRequest) -> bytes:
    return request.data if isinstance(request, RawRequest) else request.SerializeToString()


def parse_request(method: _descriptor.MethodDescriptor, request: Any) -> Message | None:
    """The request as the server parsed it (None: it did not parse, or it is a stream)."""
    if isinstance(request, RawRequest):
        try:
            return GetMessageClass(method.input_type).FromString(request.data)
        except Exception:  # noqa: BLE001 - DecodeError, or bad UTF-8 in a string field
            return None
    return request if isinstance(request, Message) else None


class _Cancel:
    """In a client-stream request list: the client gives up there (gRPC cancels the call)."""

    def __repr__(self) -> str:
        return "CANCEL"


CANCEL = _Cancel()


class ClientGaveUp(Exception):
    """Raised by the request iterator of a client stream at CANCEL."""


def until_cancel(messages: Sequence[Any]) -> Iterator[Message]:
    """The messages of a client stream, until a CANCEL: raising in the request iterator is
    how a gRPC client abandons the call (it ends CANCELLED on the client's side)."""
    for message in messages:
        if message is CANCEL:
            raise ClientGaveUp()
        yield message


def describe(request: Any, limit: int = 4000) -> str:
    """A request (a message, raw bytes, or a client stream) as text, bounded."""
    items = request if isinstance(request, list) else [request]
    parts = [text_format.MessageToString(m, as_one_line=True) if isinstance(m, Message) else repr(m) for m in items]
    text = " | ".join(parts) if isinstance(request, list) else parts[0]
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def find_string_field(message: Message, name: str) -> str:
    """The value of string field `name` in `message` or one level down (stream headers)."""
    if name in message.DESCRIPTOR.fields_by_name:
        return str(getattr(message, name))
    for f in message.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated and message.HasField(f.name):
            inner = getattr(message, f.name)
            if name in inner.DESCRIPTOR.fields_by_name:
                return str(getattr(inner, name))
    return ""
