"""Black box: `enginectl serve` as a subprocess, driven with the real grpcurl binary.

This server is started with a bearer token, so it also shows that mutating RPCs need it and
reads, health and reflection do not. Tests run in file order: the first sees a fresh
incarnation, the last sends SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.serving import BIN, ServeProcess, alive

TOKEN = "s3cret-token-for-tests"
SERVICES = {
    "enginectl.weights.v1.WeightVersionService",
    "enginectl.weights.v1.WeightUpdateService",
    "enginectl.fpm.v1.FpmIdentityService",
    "enginectl.fpm.v1.ForwardPassMetricsService",
    "google.longrunning.Operations",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
    "vllm.grpc.engine.VllmEngine",  # rollouts over gRPC (server/rollouts.py)
}
REFLECTION = {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
WV = "enginectl.weights.v1.WeightVersionService"
SIGTERM_EXIT_BOUND_S = 60.0


@pytest.fixture(scope="module")
def blackbox(serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    env = {**serve_env, "TMPDIR": str(tmp_path_factory.mktemp("tmp"))}  # what it leaves, last test
    srv = ServeProcess(["--token-file", str(token_file)], env).start().wait_ready()
    yield srv
    srv.kill()


def grpcurl(
    target: str,
    *args: str,
    data: dict | None = None,
    token: str | None = None,
    flags: tuple[str, ...] = (),
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "grpcurl"), "-plaintext", "-max-time", str(int(timeout)), *flags]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [target, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)


def grpcurl_json(target: str, *args: str, **kwargs: object) -> dict:
    result = grpcurl(target, *args, **kwargs)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_fresh_server_is_undeclared_then_placeholders_are_real_versions(blackbox: ServeProcess) -> None:
    target = blackbox.grpc_target
    fresh = grpcurl_json(target, f"{WV}/GetWeightVersion", flags=("-emit-defaults",))["weight_version"]
    assert fresh["declared"] is False
    assert "version" not in fresh  # absent, not a placeholder string
    assert fresh["revision"] == "0"
    assert fresh["source"] == "WEIGHT_SOURCE_UNSPECIFIED"
    assert fresh["incarnation"] == blackbox.serving["incarnation"]

    for revision, version in enumerate(["initial", "default", "0"], start=1):
        set_ = grpcurl_json(target, f"{WV}/SetWeightVersion", data={"version": version}, token=TOKEN)
        got = grpcurl_json(target, f"{WV}/GetWeightVersion")
        assert got == set_
        wv = got["weight_version"]
        assert (wv["declared"], wv["version"], wv["revision"]) == (True, version, str(revision))
        assert wv["source"] == "WEIGHT_SOURCE_DECLARED"


def test_list_and_describe_through_reflection(blackbox: ServeProcess) -> None:
    listed = grpcurl(blackbox.grpc_target, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == SERVICES
    described = grpcurl(blackbox.grpc_target, "describe", WV)
    assert described.returncode == 0, described.stderr
    for rpc in ("GetWeightVersion", "SetWeightVersion", "WatchWeightVersion", "VerifyWeights"):
        assert f"rpc {rpc}" in described.stdout
    message = grpcurl(blackbox.grpc_target, "describe", "enginectl.weights.v1.WeightVersion")
    assert message.returncode == 0, message.stderr
    for field in ("declared", "version", "revision", "incarnation", "etag", "source", "declare_time"):
        assert f" {field} = " in message.stdout


def test_a_client_that_speaks_only_reflection_v1_lists_describes_and_calls(blackbox: ServeProcess) -> None:
    """`buf curl` told to use grpc.reflection.v1 alone (as clients that dropped the v1alpha draft
    do): the same services are listed, and a call is described and made from what it read."""
    url = f"http://{blackbox.grpc_target}"
    base = [str(BIN / "buf"), "curl", "--protocol", "grpc", "--http2-prior-knowledge"]
    for protocol in ("grpc-v1", "grpc-v1alpha"):
        reflect = [*base, "--reflect-protocol", protocol]
        listed = subprocess.run([*reflect, "--list-services", url], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert set(listed.stdout.split()) == SERVICES, protocol
        # Every service's methods: the client reads each service's file descriptor.
        methods = subprocess.run([*reflect, "--list-methods", url], capture_output=True, text=True, timeout=60)
        assert methods.returncode == 0, methods.stderr
        assert {f"{WV}/GetWeightVersion", "grpc.reflection.v1.ServerReflection/ServerReflectionInfo"} <= set(
            methods.stdout.split()
        ), protocol
        got = subprocess.run([*reflect, f"{url}/{WV}/GetWeightVersion"], capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        # buf prints JSON field names (camelCase), grpcurl the proto's: the same resource.
        expected = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion")["weight_version"]
        answered = json.loads(got.stdout)["weightVersion"]
        assert (answered["etag"], answered["incarnation"]) == (expected["etag"], expected["incarnation"]), protocol
    described = grpcurl(blackbox.grpc_target, "describe", "grpc.reflection.v1.ServerReflection")
    assert described.returncode == 0, described.stderr
    assert "stream .grpc.reflection.v1.ServerReflectionRequest" in described.stdout


def test_health_is_serving_for_server_and_each_service(blackbox: ServeProcess) -> None:
    assert grpcurl_json(blackbox.grpc_target, "grpc.health.v1.Health/Check") == {"status": "SERVING"}
    for service in SERVICES - {"grpc.health.v1.Health", *REFLECTION}:
        checked = grpcurl_json(blackbox.grpc_target, "grpc.health.v1.Health/Check", data={"service": service})
        assert checked == {"status": "SERVING"}, service


def test_mutating_rpc_needs_the_token_and_changes_nothing_without_it(blackbox: ServeProcess) -> None:
    before = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion")
    for token in (None, "wrong-token"):
        refused = grpcurl(blackbox.grpc_target, f"{WV}/SetWeightVersion", data={"version": "sneaky"}, token=token)
        assert refused.returncode != 0
        assert "Code: Unauthenticated" in refused.stderr
        assert '"reason":"UNAUTHENTICATED"' in refused.stderr.replace(" ", "")
    assert grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion") == before


def test_bad_input_over_grpcurl_has_status_and_reason(blackbox: ServeProcess) -> None:
    before = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion")
    cases = [
        ({}, "InvalidArgument", "VERSION_REQUIRED"),
        ({"version": "x" * 257}, "InvalidArgument", "VERSION_TOO_LONG"),
        ({"version": "v", "request_id": "nope"}, "InvalidArgument", "REQUEST_ID_INVALID"),
        ({"version": "v", "etag": "stale"}, "Aborted", "ETAG_MISMATCH"),
    ]
    for data, code, reason in cases:
        result = grpcurl(blackbox.grpc_target, f"{WV}/SetWeightVersion", data=data, token=TOKEN)
        assert result.returncode != 0
        assert f"Code: {code}" in result.stderr, result.stderr
        assert f'"reason":"{reason}"' in result.stderr.replace(" ", ""), result.stderr
    assert grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion") == before


def test_etag_from_another_incarnation_is_refused(blackbox: ServeProcess, server: ServeProcess) -> None:
    """Two live servers: an etag minted by one never matches on the other."""
    other = grpcurl_json(server.grpc_target, f"{WV}/GetWeightVersion", flags=("-emit-defaults",))["weight_version"]
    mine = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion", flags=("-emit-defaults",))["weight_version"]
    assert other["incarnation"] != mine["incarnation"]
    result = grpcurl(
        blackbox.grpc_target, f"{WV}/SetWeightVersion", data={"version": "cross", "etag": other["etag"]}, token=TOKEN
    )
    assert "Code: Aborted" in result.stderr
    assert '"reason":"ETAG_MISMATCH"' in result.stderr.replace(" ", "")
    after = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion", flags=("-emit-defaults",))["weight_version"]
    assert after == mine


def test_mutations_and_failures_are_logged_with_request_id_code_and_duration(blackbox: ServeProcess) -> None:
    ok = grpcurl(
        blackbox.grpc_target,
        f"{WV}/SetWeightVersion",
        data={"version": "logged"},
        token=TOKEN,
        flags=("-H", "x-request-id: req-ok-1"),
    )
    assert ok.returncode == 0, ok.stderr
    bad = grpcurl(
        blackbox.grpc_target,
        f"{WV}/SetWeightVersion",
        data={"version": ""},
        token=TOKEN,
        flags=("-H", "x-request-id: req-bad-1"),
    )
    assert bad.returncode != 0
    refused = grpcurl(
        blackbox.grpc_target,
        f"{WV}/SetWeightVersion",
        data={"version": "x"},
        flags=("-H", "x-request-id: req-noauth-1"),
    )
    assert refused.returncode != 0
    for request_id, code in (
        ("req-ok-1", "OK"),
        ("req-bad-1", "INVALID_ARGUMENT"),
        ("req-noauth-1", "UNAUTHENTICATED"),
    ):
        event = blackbox.wait_for_event(lambda e, request_id=request_id: e.get("request_id") == request_id)
        assert event["event"] == "rpc"
        assert event["rpc"] == f"/{WV}/SetWeightVersion"
        assert event["code"] == code
        assert event["duration_ms"] >= 0


def test_server_info_over_grpcurl_says_auth_is_required(blackbox: ServeProcess) -> None:
    info = grpcurl_json(blackbox.grpc_target, "enginectl.weights.v1.WeightUpdateService/GetServerInfo")
    assert info["auth_required"] is True
    assert info["model"] == blackbox.model
    assert f"{WV}/SetWeightVersion" in info["supported_rpcs"]


def test_grpc_rollouts_need_no_token_but_their_admin_rpcs_do(blackbox: ServeProcess) -> None:
    """Generation is the data plane: open without a token (unless --token-guards-rollouts);
    the trailers name the declared version. FlushCache changes what the engine serves: guarded."""
    grpcurl_json(blackbox.grpc_target, f"{WV}/SetWeightVersion", data={"version": "rollout v1,ü"}, token=TOKEN)
    data = {"request_id": "bb-1", "text": "Hello world", "sampling_params": {"max_tokens": 4, "temperature": 0}}
    generated = grpcurl(blackbox.grpc_target, "vllm.grpc.engine.VllmEngine/Generate", data=data, flags=("-v",))
    assert generated.returncode == 0, generated.stderr
    assert '"finish_reason": "length"' in generated.stdout
    trailers = generated.stdout.split("Response trailers received:", 1)[1]
    assert "enginectl-weight-declared: true" in trailers
    assert "enginectl-weight-versions: rollout%20v1%2C%C3%BC" in trailers
    version = grpcurl_json(blackbox.grpc_target, f"{WV}/GetWeightVersion")["weight_version"]
    assert f"enginectl-weight-revision: {version['revision']}" in trailers

    refused = grpcurl(blackbox.grpc_target, "vllm.grpc.engine.VllmEngine/FlushCache")
    assert "Code: Unauthenticated" in refused.stderr, refused.stderr
    flushed = grpcurl_json(blackbox.grpc_target, "vllm.grpc.engine.VllmEngine/FlushCache", token=TOKEN)
    assert flushed.get("success") is True, flushed


def test_colocated_http_api_generates(blackbox: ServeProcess) -> None:
    body = json.dumps(
        {"model": blackbox.served_model, "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{blackbox.http_url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.load(response)
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["finish_reason"] == "length"
    # The control plane still answers while and after the HTTP API serves.
    assert grpcurl_json(blackbox.grpc_target, "grpc.health.v1.Health/Check") == {"status": "SERVING"}


def test_sigterm_ends_streams_and_exits_zero_leaving_no_child(blackbox: ServeProcess) -> None:
    children = blackbox.descendants()
    assert children, "the engine runs in child processes"
    watch = subprocess.Popen(
        [str(BIN / "grpcurl"), "-plaintext", "-max-time", "120", blackbox.grpc_target, f"{WV}/WatchWeightVersion"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    health = subprocess.Popen(
        [str(BIN / "grpcurl"), "-plaintext", "-max-time", "120", blackbox.grpc_target, "grpc.health.v1.Health/Watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None and health.stdout is not None
    assert watch.stdout.readline().startswith("{")  # the current state: the stream is live
    assert health.stdout.readline().startswith("{")
    started = time.monotonic()
    code = blackbox.terminate(timeout=SIGTERM_EXIT_BOUND_S)
    elapsed = time.monotonic() - started
    assert code == 0, blackbox.tail()
    assert elapsed < SIGTERM_EXIT_BOUND_S
    _, err = watch.communicate(timeout=30)
    assert "Code: Unavailable" in err
    rest, _ = health.communicate(timeout=30)
    assert '"NOT_SERVING"' in rest  # health flipped before the server went away
    assert not alive(children), [p.pid for p in alive(children)]
    # Nothing left in its temp directory but caches: no socket of vLLM's (server/engine_processes.py
    # engine_ipc_dir) or of enginectl's own, no enginectl directory.
    tmp = Path(blackbox.env["TMPDIR"])
    left = [p for p in tmp.rglob("*") if p.is_socket() or p.name.startswith("enginectl-")]
    assert not left, left
    events = blackbox.events()
    names = [e.get("event") for e in events]
    assert names.index("shutting down") < names.index("stopped")
    assert events[names.index("stopped")]["exit_code"] == 0
