"""Fuzz every RPC the server registers, over real gRPC, with requests built from the
protobuf descriptors (hypothesis).

One `enginectl serve` of its own (fuzzed mutations would disturb the session's shared
server), allowed to load weights from a directory of good and bad files made here. The
services come from the generated modules' descriptors, so a new RPC is fuzzed without
touching this file; `test_every_registered_rpc_is_fuzzed` checks against server reflection
and GetServerInfo.supported_rpcs that none is missed.

For every call (the error contract of the protos' service comments):
- the status is never UNKNOWN or INTERNAL and no message carries a Python traceback;
- every error carries a google.rpc.Status whose ErrorInfo has domain "enginectl.dev" and a
  stable UPPER_SNAKE reason listed in `enginectl.client.errors.Reason` (a DEADLINE_EXCEEDED
  or CANCELLED without one is the client's own: counted, and never allowed for a unary
  call, whose every wait is bounded by the request);
- a refusal leaves the WeightVersion resource and gRPC health as they were right before
  the call (a failure after writing began, PARTIAL_UPDATE, leaves it undeclared with
  `last_failure`, as weight_update_service.proto rule 6 says); a read changes nothing;
- an update that returns an Operation ends, and its error (if any) follows the same rules;
  a success's response carries the resource as it is now (rule 5); a retried request_id
  replays the first answer and changes nothing;
- generation, running before every call, is paused afterwards only by a successful
  PauseGeneration or a PARTIAL_UPDATE (rules 3 and 6);
- an error's status fits in gRPC's trailers (TRAILER_BUDGET), whatever the request held;
- bytes that do not parse are INVALID_ARGUMENT MALFORMED_REQUEST;
- a few promises the protos make about single fields (`_postconditions`, `_check_resource`).
Successful mutations are allowed; a fuzzed pause is undone (ResumeGeneration force=true)
so later calls and the closing generation over HTTP mean something. Requests are drawn
with a fixed seed (derandomize): CI runs the same ones every time.

Fuzzed values never make the engine wait long or reach the network: every Duration is
either at most 2 s or outside what the server accepts, `master_address` is loopback (or
invalid), and `master_port` is a port bound here that nobody listens on.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import os
import pkgutil
import re
import shutil
import socket
import stat
import struct
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from google.longrunning import operations_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import duration_pb2, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from serving import ServeProcess

from enginectl.client.errors import DOMAIN, Reason
from enginectl.fpm.v1 import fpm_identity_service_pb2 as fpb
from enginectl.server.interceptors import is_read_only
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

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


# --- budgets ----------------------------------------------------------------------------

DEFAULT_EXAMPLES = 60
# Calls that wait by design (a stream's window, a group rendezvous that can not complete)
# get fewer examples, the updates more (they have the most to check), so the module stays
# around a minute or two.
EXAMPLES = {
    "StreamForwardPassMetrics": 20,
    "WatchWeightVersion": 20,
    "InitWeightsUpdateGroup": 20,
    "UpdateWeightsFromDisk": 80,
    "UpdateWeightsFromTensors": 100,
}
UNARY_DEADLINE_S = 10.0  # far beyond any bound a fuzzed request can ask for (2 s)
STREAM_WINDOW_S = 0.6  # how long a server stream is read
STREAM_MAX_MESSAGES = 3
OPERATION_BUDGET_S = 60.0  # an accepted update must end within this
MAX_FUZZ_TIMEOUT_NS = 2 * 10**9
# Beyond every timeout bound the server has (ServerLimits.max_timeout, 24 h, is the largest).
NEVER_ACCEPTED_S = 10**6
# grpc-message + grpc-status-details-bin of an error, in bytes on the wire: a default client
# accepts 8 KiB of metadata in all; the rest of the trailers and headers need some of it.
TRAILER_BUDGET = 7 * 1024
UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")
KNOWN_REASONS = {value for name, value in vars(Reason).items() if name.isupper()}

# --- edge values ------------------------------------------------------------------------

EDGE_STRINGS = [
    "",
    " ",
    "0",
    "-1",
    "\x00",
    "a\x00b",
    "\n",
    "line\nbreak",
    "\r\n",
    "\t",
    "\x1b[31m",
    "\x7f",
    "\x01\x02",
    "\u0085",
    "\u2028",
    "\u202e",
    "\ufeff",
    "ü",
    "💥",
    "a" * 256,
    "a" * 257,
    "ü" * 128,
    "ü" * 129,
    "%s%n%x",
    "{}",
    "'\"",
    "operations/",
    "../../etc/passwd",
    "None",
    "null",
    "NaN",
    "1e309",
]
INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as often as its weight says (st.one_of gives every
    distinct strategy the same share, however often it is listed); the first is simplest."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def edge_ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(
        {
            v
            for v in (
                lo,
                hi,
                0,
                1,
                2,
                3,
                -1,
                255,
                256,
                65535,
                65536,
                65537,
                2**31 - 1,
                2**31,
                2**32 - 1,
                2**32,
                2**53,
                2**63 - 1,
            )
            if lo <= v <= hi
        }
    )
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def huge_string() -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(["x", "ü", "💥", "/", "\x01"]), st.integers(257, 5000)).map(lambda t: t[0] * t[1])


STRINGS: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(EDGE_STRINGS),
    st.text(max_size=24),
    huge_string(),
)
BYTES: st.SearchStrategy[bytes] = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 300]))

SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: STRINGS,
    FieldDescriptor.TYPE_BYTES: BYTES,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: edge_ints(*INT32),
    FieldDescriptor.TYPE_SINT32: edge_ints(*INT32),
    FieldDescriptor.TYPE_SFIXED32: edge_ints(*INT32),
    FieldDescriptor.TYPE_UINT32: edge_ints(*UINT32),
    FieldDescriptor.TYPE_FIXED32: edge_ints(*UINT32),
    FieldDescriptor.TYPE_INT64: edge_ints(*INT64),
    FieldDescriptor.TYPE_SINT64: edge_ints(*INT64),
    FieldDescriptor.TYPE_SFIXED64: edge_ints(*INT64),
    FieldDescriptor.TYPE_UINT64: edge_ints(*UINT64),
    FieldDescriptor.TYPE_FIXED64: edge_ints(*UINT64),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
}


def short_durations() -> st.SearchStrategy[duration_pb2.Duration]:
    """Accepted timeouts, from 1 ns (expires before anything happens) to 2 s."""
    return st.integers(1, MAX_FUZZ_TIMEOUT_NS).map(
        lambda ns: duration_pb2.Duration(seconds=ns // 10**9, nanos=ns % 10**9)
    )


def durations() -> st.SearchStrategy[duration_pb2.Duration]:
    """Either within (0, 2 s] (accepted: bounded waits), or outside what any RPC accepts:
    zero, negative, above every max_timeout, beyond Duration's own range, bad nanos."""

    def make(seconds: int, nanos: int) -> duration_pb2.Duration:
        return duration_pb2.Duration(seconds=seconds, nanos=nanos)

    short = short_durations()
    out_of_range = st.one_of(
        st.sampled_from(
            [
                (0, 0),
                (0, -1),
                (-1, 0),
                (-1, -999_999_999),
                (*INT64[:1], 0),
                (INT64[1], 0),
                (315_576_000_001, 0),
                (-315_576_000_001, 0),
                (NEVER_ACCEPTED_S, 0),
                (NEVER_ACCEPTED_S + 1, -1),
                (10**12, 0),
                (1, 10**9),
            ]
        ).map(lambda t: make(*t)),
        st.integers(NEVER_ACCEPTED_S, INT64[1]).map(lambda s: make(s, 0)),
        st.integers(INT64[0], -1).map(lambda s: make(s, 0)),
    )
    return weighted((2, short), (1, out_of_range))


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


# --- the server and the files it may load ---------------------------------------------------


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file: name -> (dtype code, shape, raw bytes)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(d for _, _, d in tensors.values()))


def _read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: (e["dtype"], e["shape"], blob[base + e["data_offsets"][0] : base + e["data_offsets"][1]])
        for name, e in header.items()
    }


DTYPE_CODES = {"F32": upb.TENSOR_DTYPE_FLOAT32, "F16": upb.TENSOR_DTYPE_FLOAT16, "BF16": upb.TENSOR_DTYPE_BFLOAT16}


def make_fodder(root: Path, model: Path) -> tuple[list[str], list[str]]:
    """Good and bad things for UpdateWeightsFromDisk to find under the allowed `root`: the
    paths to fuzz with (inside the root and out), and those that load (the model's values)."""
    checkpoint = model / "model.safetensors"
    tensors = _read_safetensors(checkpoint)
    norms = {k: v for k, v in tensors.items() if k.endswith("norm.weight")}
    (root / "good").mkdir()
    shutil.copy(checkpoint, root / "good" / "model.safetensors")
    (root / "subset").mkdir()
    _safetensors(root / "subset" / "model.safetensors", norms)  # the same values: loads, changes nothing
    _safetensors(
        root / "f16.safetensors",
        {  # floats are cast on load
            k: ("F16", shape, np.frombuffer(data, "<f4").astype("<f2").tobytes())
            for k, (_, shape, data) in norms.items()
        },
    )
    _safetensors(root / "int.safetensors", {k: ("I32", s, d) for k, (_, s, d) in norms.items()})
    _safetensors(root / "unknown.safetensors", {"no.such.weight": ("F32", [2], b"\x00" * 8)})
    name, (dtype, shape, data) = next(iter(norms.items()))
    _safetensors(root / "shape.safetensors", {name: (dtype, [shape[0] // 2], data[: len(data) // 2])})
    (root / "index").mkdir()
    shutil.copy(root / "subset" / "model.safetensors", root / "index" / "part.safetensors")
    (root / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "part.safetensors" for k in norms}})
    )
    (root / "badindex").mkdir()
    (root / "badindex" / "up.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "../good/model.safetensors"}})
    )
    (root / "badindex" / "missing.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "gone.safetensors"}})
    )
    (root / "badindex" / "broken.safetensors.index.json").write_text("{")
    (root / "empty.safetensors").write_bytes(b"")
    (root / "truncated.safetensors").write_bytes(checkpoint.read_bytes()[:1000])
    (root / "garbage.safetensors").write_bytes(struct.pack("<Q", 5) + b"{]}[x")
    (root / "hugeheader.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    (root / "list.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    (root / "notensor.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (root / "offsets.safetensors").write_bytes(
        struct.pack("<Q", 60)
        + json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 9999]}}).encode().ljust(60)
    )
    (root / "pickle").mkdir()
    (root / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    (root / "emptydir").mkdir()
    (root / "dir.safetensors").mkdir()
    (root / "new\nline.safetensors").write_bytes((root / "subset" / "model.safetensors").read_bytes())
    (root / "escape").symlink_to("/etc")
    (root / "escape.safetensors").symlink_to("/etc/hostname")
    (root / "inner.safetensors").symlink_to(root / "subset" / "model.safetensors")
    (root / "loop.safetensors").symlink_to(root / "loop.safetensors")
    os.mkfifo(root / "fifo.safetensors")
    (root / "fifodir").mkdir()
    os.mkfifo(root / "fifodir" / "model.safetensors")
    try:  # character devices inside the root (we run as root here and in CI)
        os.mknod(root / "zero.safetensors", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        os.mknod(root / "urandom.safetensors", 0o600 | stat.S_IFCHR, os.makedev(1, 9))
    except PermissionError:
        pass
    inside = sorted(str(p) for p in root.rglob("*")) + [
        str(root),
        f"{root}/",
        f"{root}/./good",
        f"{root}/../{root.name}/good",
    ]
    outside = [
        "",
        "/",
        "good",
        "./good",
        "/etc/passwd",
        "/proc/self/environ",
        "/dev/zero",
        "/nonexistent",
        f"{root}/nope",
        f"{root}/good/\x00x",
        "/" + "x" * 5000,
        f"{root}/" + "ü" * 2100,
        str(checkpoint),
        str(root.parent),
    ]
    good = [
        f"{root}/good",
        f"{root}/subset/model.safetensors",
        f"{root}/index",
        f"{root}/f16.safetensors",
        f"{root}/inner.safetensors",
    ]
    return inside + outside, good


@dataclass
class Outcome:
    code: grpc.StatusCode
    response: Any = None
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    message: str = ""
    client_side: bool = False  # the client's own deadline or cancellation


@dataclass
class Fuzzer:
    """Sends fuzzed requests and checks every outcome against the error contract."""

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
        self.builder = MessageBuilder(self, HINTS)
        self.tensor_names = sorted(self.tensors)
        # Small tensors (norm weights, 512 bytes) carry the coherent streams: their own values.
        self.small = sorted(k for k, (_, shape, _) in self.tensors.items() if len(shape) == 1)
        self.version = self.get_version()
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.limits = self._unary(
            "/enginectl.weights.v1.WeightUpdateService/GetServerInfo",
            upb.GetServerInfoRequest(),
            upb.GetServerInfoResponse,
        ).limits
        self._too_many: list[Message] | None = None
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

    # --- calling and checking ---

    def call(self, method: _descriptor.MethodDescriptor, request: Any) -> Outcome:
        path = f"/{rpc_name(method)}"
        output = GetMessageClass(method.output_type)
        kwargs: dict[str, Any] = {"request_serializer": _serialize, "response_deserializer": output.FromString}
        if method.client_streaming and method.server_streaming:
            raise NotImplementedError("no bidirectional RPC to fuzz yet")
        if method.server_streaming:
            return self._read_stream(self.channel.unary_stream(path, **kwargs), request)
        if method.client_streaming:
            invoke = self.channel.stream_unary(path, **kwargs)
            return self._unary_outcome(
                lambda: invoke(_sent(request), timeout=UNARY_DEADLINE_S), gave_up=any(m is CANCEL for m in request)
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
                rid = _find(message, rid_field)
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
        assert health_after == health_before, f"health {health_before} -> {health_after}: {described}"
        partial = Reason.PARTIAL_UPDATE in (outcome.reason, op_failed) and not replayed
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
        parsed = _parsed(method, request)
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


def _trailer_bytes(status: status_pb2.Status) -> int:
    """Wire size of the grpc-message (percent-encoded) and grpc-status-details-bin (base64)
    trailers that carry `status`."""
    message = sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in status.message.encode())
    return message + len(base64.b64encode(status.SerializeToString()))


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _check_resource(version: wv.WeightVersion, described: str) -> None:
    """WeightVersion.version: set iff declared; non-empty UTF-8, at most 256 bytes, without
    control characters (whatever declared it: SetWeightVersion or an update)."""
    assert version.declared == version.HasField("version"), f"{described}: {version}"
    if version.declared:
        assert 0 < len(version.version.encode()) <= 256, f"{described}: declared {version.version!r}"
        assert not CONTROL.search(version.version), f"{described}: declared {version.version!r} (a control character)"


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


def _serialize(request: Message | RawRequest) -> bytes:
    return request.data if isinstance(request, RawRequest) else request.SerializeToString()


def _parsed(method: _descriptor.MethodDescriptor, request: Any) -> Message | None:
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


def _sent(messages: Sequence[Any]) -> Iterator[Message]:
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


def _find(message: Message, name: str) -> str:
    """The value of string field `name` in `message` or one level down (stream headers)."""
    if name in message.DESCRIPTOR.fields_by_name:
        return str(getattr(message, name))
    for f in message.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated and message.HasField(f.name):
            inner = getattr(message, f.name)
            if name in inner.DESCRIPTOR.fields_by_name:
                return str(getattr(inner, name))
    return ""


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dead_port() -> Iterator[int]:
    """A loopback port bound (so nobody else takes it) but never listening: connecting to it
    is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def fuzz_server(
    serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServeProcess, Path]]:
    root = tmp_path_factory.mktemp("fuzz-weights")
    srv = ServeProcess(["--enable-scale-out", "--allow-weights-from", str(root)], serve_env).start().wait_ready()
    try:
        yield srv, root
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill()


@pytest.fixture(scope="module")
def fuzzer(fuzz_server: tuple[ServeProcess, Path], dead_port: int) -> Iterator[Fuzzer]:
    srv, root = fuzz_server
    paths, good = make_fodder(root, Path(srv.model))
    fz = Fuzzer(srv, paths, good, dead_port, _read_safetensors(Path(srv.model) / "model.safetensors"))
    yield fz
    fz.close()


# --- tests --------------------------------------------------------------------------------


def test_every_registered_rpc_is_fuzzed(fuzz_server: tuple[ServeProcess, Path]) -> None:
    """The services found in the generated modules are the ones the server registers
    (reflection), and every RPC it says it supports is among them."""
    srv, _ = fuzz_server
    with grpc.insecure_channel(srv.grpc_target) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        registered = {s.name for a in answers for s in a.list_services_response.service}
        info = upb.GetServerInfoResponse.FromString(
            channel.unary_unary(
                "/enginectl.weights.v1.WeightUpdateService/GetServerInfo",
                request_serializer=lambda m: m.SerializeToString(),
            )(upb.GetServerInfoRequest(), timeout=10)
        )
    ours = registered - {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert ours == {s.full_name for s in SERVICES}
    assert set(info.supported_rpcs) <= {rpc_name(m) for m in METHODS}


@pytest.mark.parametrize("method", METHODS, ids=rpc_name)
def test_fuzz_rpc(fuzzer: Fuzzer, method: _descriptor.MethodDescriptor) -> None:
    """Fuzzed requests to one RPC: every outcome keeps the error contract and the state rules."""

    @settings(
        max_examples=EXAMPLES.get(method.name, DEFAULT_EXAMPLES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        request = data.draw(fuzzer.request(method), label="request")
        try:
            fuzzer.check(method, request)
        except BaseException:
            note(f"request as sent: {describe(request)}")  # the draw's repr shows strategies, not values
            raise

    fuzz()


def test_engine_still_serves_after_fuzzing(fuzzer: Fuzzer) -> None:
    """After everything above: health SERVING, generation running, and a generation over
    vLLM's HTTP API works."""
    assert fuzzer.health() == health_pb2.HealthCheckResponse.SERVING
    assert not fuzzer.generation_state().paused
    body = json.dumps({"token_ids": [1, 43, 375, 82], "sampling_params": {"max_tokens": 6, "temperature": 0.0}})
    request = urllib.request.Request(
        f"{fuzzer.server.http_url}/inference/v1/generate",
        data=body.encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.load(response)
    assert len(out["choices"][0]["token_ids"]) > 0
    print("fuzzed outcomes:", dict(sorted(fuzzer.counts.items())))
