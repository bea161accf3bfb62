"""Fuzz values for tests/e2e/test_fuzz.py: the budgets every fuzzed call keeps, and hypothesis
strategies for scalars with edge values and for Durations (accepted, or never accepted)."""

from __future__ import annotations

from typing import Any

from google.protobuf import duration_pb2
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

# --- budgets ----------------------------------------------------------------------------

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
