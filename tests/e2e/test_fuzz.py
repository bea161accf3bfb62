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
- a few promises the protos make about single fields (fuzz_checker.py: `_postconditions`,
  `_check_resource`).
Successful mutations are allowed; a fuzzed pause is undone (ResumeGeneration force=true)
so later calls and the closing generation over HTTP mean something. Requests are drawn
with a fixed seed (derandomize): CI runs the same ones every time.

Fuzzed values never make the engine wait long or reach the network: every Duration is
either at most 2 s or outside what the server accepts, `master_address` is loopback (or
invalid), and `master_port` is a port bound here that nobody listens on.

The machinery lives beside this file: fuzz_strategies.py (budgets, edge values), fuzz_requests.py
(requests from descriptors), fuzz_fodder.py (the files to load), fuzz_calls.py (calls and the
error contract) and fuzz_checker.py (the Fuzzer: strategies and the checks after every call).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from support.fuzz.calls import METHODS, SERVICES, rpc_name
from support.fuzz.checker import Fuzzer
from support.fuzz.fodder import make_fodder, read_safetensors
from support.fuzz.requests import describe
from support.serving import ServeProcess

from enginectl.weights.v1 import weight_update_service_pb2 as upb

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
    fz = Fuzzer(srv, paths, good, dead_port, read_safetensors(Path(srv.model) / "model.safetensors"))
    yield fz
    fz.close()


# --- tests --------------------------------------------------------------------------------


ROLLOUTS = "vllm.grpc.engine.VllmEngine"


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
    # vLLM's own VllmEngine (rollouts on the control port, server/rollouts.py) is not fuzzed
    # here: its requests are vLLM's to validate (tests/e2e/weight_updates/test_rollouts_grpc.py covers a refusal).
    theirs = {
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        ROLLOUTS,
    }
    ours = registered - theirs
    assert ours == {s.full_name for s in SERVICES}
    assert {rpc for rpc in info.supported_rpcs if not rpc.startswith(ROLLOUTS)} <= {rpc_name(m) for m in METHODS}


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
