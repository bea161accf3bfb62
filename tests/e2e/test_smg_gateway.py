"""Two enginectl servers behind the real SMG gateway (PyPI `smg`), driven as RL frameworks do.

The servers register themselves (`--gateway`), hold a token (SMG passes each worker's
`api_key` on as `Authorization: Bearer`) and run with VLLM_SERVER_DEV_MODE=1, so vLLM's own
dev routes exist and enginectl's must answer in their place. Shown here
(docs/rollouts.md, "Behind the SMG gateway"):

- `smg.rl.paused()` + `update_weights_from_disk` fanned out through SMG updates both servers:
  both record the version (source DISK), their tokens change, and /v1/rl/workers shows the
  version on both within 2 s;
- a route that changes state needs the token; SMG's fan-out carries it;
- quarantine through the gateway: with rollouts flowing through SMG from several clients, a
  partial update on one server (its trainer killed mid-stream) takes it out of SMG's rotation
  within one health interval plus one check, no completion SMG returns after that comes from
  it, vLLM's dev `/resume` cannot lift its pause, and a successful update brings it back.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from smg.rl import RL, paused
from support.fault_helpers import WRITTEN_BYTES, stalled_stream
from support.fault_helpers import Stubs as FaultStubs
from support.rl_http import call
from support.serving import ServeProcess
from support.smg import SmgGateway
from support.weight_updates import Stubs
from support.weights import Checkpoints, build_checkpoints, greedy_tokens, stop_server
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

TOKEN = "smg-test-token"
HEALTH_INTERVAL_S = 1
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build_checkpoints(serve_env, tmp_path_factory.mktemp("smg-weights"))


@pytest.fixture(scope="module")
def gateway() -> Iterator[SmgGateway]:
    """SMG checking health every second; one failed check takes a worker out, one good one
    brings it back (its defaults are 3 and 2 checks, 60 s apart: docs/rollouts.md)."""
    smg = SmgGateway(
        health_check_interval_s=HEALTH_INTERVAL_S,
        extra_args=["--health-failure-threshold", "1", "--health-success-threshold", "1"],
    ).start()
    yield smg
    assert smg.stop() is not None


@pytest.fixture(scope="module")
def servers(
    serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, checkpoints: Checkpoints, gateway: SmgGateway
) -> Iterator[list[ServeProcess]]:
    token_file = tmp_path_factory.mktemp("smg-token") / "token"
    token_file.write_text(TOKEN + "\n")
    env = dict(serve_env, VLLM_SERVER_DEV_MODE="1", ENGINECTL_TOKEN=TOKEN)
    args = ["--token-file", str(token_file), "--allow-weights-from", str(checkpoints.root), "--gateway", gateway.url]
    # The first also runs vLLM's transfer engine `gloo` (vLLM's flag); the second runs none.
    transfer = ["--weight-transfer-config", '{"backend": "gloo"}']
    started = [ServeProcess(args + (transfer if i == 0 else []), env).start() for i in range(2)]
    try:
        for srv in started:
            srv.wait_ready()
        urls = {f"grpc://127.0.0.1:{srv.grpc_target.rsplit(':', 1)[1]}" for srv in started}
        gateway.wait_for(lambda rows: urls <= {r["url"] for r in rows if r["health"] == "ready"}, timeout=60)
        yield started
    finally:
        for srv in started:
            stop_server(srv)


@pytest.fixture(scope="module")
def stubs(servers: list[ServeProcess]) -> list[Stubs]:
    out = [Stubs(srv) for srv in servers]
    for s in out:
        s.timeout = 30.0
    return out


def _row(gateway: SmgGateway, srv: ServeProcess) -> dict[str, Any]:
    url = f"grpc://127.0.0.1:{srv.grpc_target.rsplit(':', 1)[1]}"
    return next(r for r in gateway.rl_workers() if r["url"] == url)


def _completion(gateway: SmgGateway, model: str, prompt: str, timeout: float = 120.0) -> dict[str, Any]:
    import json

    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{gateway.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.load(response)
        return answer


def _requests_done(srv: ServeProcess) -> float:
    """Requests the server finished, from vLLM's /metrics (every finish reason)."""
    with urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_smg_rl_fanout_updates_both_servers_and_smg_learns_the_version(
    servers: list[ServeProcess], stubs: list[Stubs], gateway: SmgGateway, checkpoints: Checkpoints
) -> None:
    before = [greedy_tokens(srv) for srv in servers]
    rl = RL(gateway.url, timeout=300)
    with paused(rl, "engine=vllm"):
        result = rl.fanout(
            "update_weights_from_disk",
            {"model_path": str(checkpoints.b), "weight_version": "smg-B"},
            selector="engine=vllm",
        )
    assert result.total == 2 and result.succeeded == 2 and not result.failed
    for s, srv, old in zip(stubs, servers, before, strict=True):
        version = s.version()
        assert version.declared and version.version == "smg-B" and version.source == 2  # DISK
        assert not s.state().paused  # paused() resumed it: continue_generation
        assert greedy_tokens(srv) != old
    began = time.monotonic()
    gateway.wait_for(lambda rows: sorted(r["weight_version"] for r in rows) == ["smg-B", "smg-B"], timeout=2.0)
    print(f"SMG shows smg-B on both {time.monotonic() - began:.3f}s after the fan-out answered")
    answer = _completion(gateway, servers[0].served_model, "hello")
    assert answer["system_fingerprint"] == "smg-B"  # not "default": the declared version


def test_a_state_changing_route_needs_the_token_and_smg_carries_it(
    servers: list[ServeProcess], stubs: list[Stubs], gateway: SmgGateway
) -> None:
    status, body = call(servers[0].http_url, "/pause_generation", {"mode": "keep"})
    assert (status, body["error"]) == (401, "UNAUTHENTICATED")
    assert not stubs[0].state().paused
    status, body = call(servers[0].http_url, "/pause_generation", {"mode": "keep"}, token="wrong")
    assert (status, body["error"]) == (401, "UNAUTHENTICATED")
    assert call(servers[0].http_url, "/get_weight_version")[0] == 200  # reads stay open
    rl = RL(gateway.url)
    rl.fanout("pause_generation", {"mode": "keep"}, selector="engine=vllm")
    assert all(s.state().paused for s in stubs)
    rl.fanout("continue_generation", {}, selector="engine=vllm")
    assert not any(s.state().paused for s in stubs)


FOUR_STEPS = [
    ("/init_weight_transfer_engine", {"init_info": {}}),
    ("/start_weight_update", {}),
    ("/update_weights", {"update_info": {}}),
    ("/finish_weight_update", {}),
    ("/shutdown_weight_transfer_engine", {}),
]


def test_vllm_four_step_routes_are_enginectl_s_need_the_token_and_name_a_missing_engine(
    servers: list[ServeProcess], stubs: list[Stubs]
) -> None:
    """vLLM's four weight-transfer routes answer as enginectl's (its token, its reasons); the
    second server runs no transfer engine (no --weight-transfer-config), and says so."""
    before = stubs[1].version()
    for path, body in FOUR_STEPS:
        status, answer = call(servers[1].http_url, path, body)
        assert (status, answer["error"]) == (401, "UNAUTHENTICATED"), path
        status, answer = call(servers[1].http_url, path, body, token=TOKEN)
        assert (status, answer["error"]) == (412, "TRANSFER_NOT_CONFIGURED"), path
    assert stubs[1].version() == before and not stubs[1].state().paused


class BearerSyncClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client with a bearer token on every step (None: no header), as a
    SkyRL- or prime-rl-style trainer posts the four routes with its own requests."""

    def __init__(self, base_url: str, token: str | None, timeout: float = 120.0) -> None:
        super().__init__(base_url, timeout)
        self.token = token

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        requests.post(f"{self.base_url}/{path}", json=json, headers=headers, timeout=self.timeout).raise_for_status()


def test_a_skyrl_style_trainer_runs_the_four_steps_with_the_token_and_through_smg(
    servers: list[ServeProcess], stubs: list[Stubs], gateway: SmgGateway, checkpoints: Checkpoints
) -> None:
    """vLLM's trainer-side API with enginectl's `gloo` engine, over vLLM's HTTP routes: without
    the token the first step is refused (401, nothing joined); with it a round applies A and
    records it (source TRANSFER_ENGINE, VerifyWeights MATCH); then the same trainer, pointed
    at SMG's proxy for that worker (SMG carries the worker's token), applies B: the tokens
    change and the version follows."""
    srv, s = servers[0], stubs[0]
    register()
    workers = s.updates.GetServerInfo(upb.GetServerInfoRequest(), timeout=10).num_workers
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0, timeout_s=60.0
    )
    before = s.version()
    with pytest.raises(requests.HTTPError) as refused:
        WeightTransferTrainerFactory.trainer_init(
            info, client=BearerSyncClient(srv.http_url, None), source=StateDictSource(checkpoints.state_dict("A"))
        )
    assert refused.value.response.status_code == 401
    assert refused.value.response.json()["error"] == "UNAUTHENTICATED"
    assert s.version() == before

    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=BearerSyncClient(srv.http_url, TOKEN), source=StateDictSource(checkpoints.state_dict("A"))
    )
    try:
        engine.send_weights(weight_version="skyrl-A")
        version = s.version()
        assert (version.version, version.source) == ("skyrl-A", wv.WEIGHT_SOURCE_TRANSFER_ENGINE)
        assert s.verify().verdict == vpb.VERIFY_VERDICT_MATCH
        tokens_a = greedy_tokens(srv)

        worker = _row(gateway, srv)["id"]
        engine.client = HTTPVLLMWeightSyncClient(f"{gateway.url}/v1/rl/workers/{worker}/engine", timeout=120)
        engine.source = StateDictSource(checkpoints.state_dict("B"))
        engine.send_weights(weight_version="skyrl-B")
        assert s.version().version == "skyrl-B" and s.verify().verdict == vpb.VERIFY_VERDICT_MATCH
        assert greedy_tokens(srv) != tokens_a
        assert not s.state().paused
    finally:
        engine.shutdown()
        BearerSyncClient(srv.http_url, TOKEN).shutdown_weight_transfer_engine()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "{b}"}}),
        ("/sleep", {}),
        ("/wake_up", {}),
        ("/weight_checker", {"action": "reset"}),
        ("/start_draft_weight_update", {}),
    ],
)
def test_vllm_dev_routes_that_would_change_weights_behind_the_ledger_are_refused(
    servers: list[ServeProcess], stubs: list[Stubs], checkpoints: Checkpoints, path: str, body: dict[str, Any]
) -> None:
    """These servers run with VLLM_SERVER_DEV_MODE=1, so vLLM's own routes exist: enginectl's
    refusal answers in their place, with the token or without."""

    if "kwargs" in body:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints.b)}}
    srv, s = servers[0], stubs[0]
    before, tokens = s.version(), greedy_tokens(srv)
    status, answer = call(srv.http_url, path, body, token=TOKEN)
    assert (status, answer["error"], answer["details"]["route"]) == (403, "ROUTE_REFUSED", path)
    assert s.version() == before and greedy_tokens(srv) == tokens
    assert s.verify().verdict == vpb.VERIFY_VERDICT_MATCH


@dataclass
class Rollouts:
    """Clients sending completions through SMG until stopped, each answer timestamped."""

    gateway: SmgGateway
    model: str
    clients: int = 3
    answers: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, fingerprint)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)]

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                answer = _completion(self.gateway, self.model, f"client {client} prompt {n} " + "x" * (n % 7))
                self.answers.append((time.monotonic(), str(answer.get("system_fingerprint"))))
            except BaseException as exc:  # noqa: BLE001 - recorded; the test asserts there are none
                self.errors.append(exc)
                return

    def __enter__(self) -> Rollouts:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def wait_for(self, count: int, after: float, timeout: float = 60.0) -> None:
        """Until `count` answers arrived after `after` (monotonic)."""
        deadline = time.monotonic() + timeout
        while sum(1 for t, _ in self.answers if t > after) < count:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"only {len(self.answers)} rollouts answered"
            self._stop.wait(0.05)  # answers arrive from other threads; nothing to wait on but them


def test_a_partial_update_takes_the_server_out_of_smg_rotation_until_an_update_succeeds(
    servers: list[ServeProcess],
    stubs: list[Stubs],
    gateway: SmgGateway,
    checkpoints: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENGINECTL_TOKEN", TOKEN)  # the trainer child's token (an environment, not a fake)
    victim, other = servers
    for srv in servers:  # both on A, declared "A"
        status, body = call(
            srv.http_url,
            "/update_weights_from_disk",
            {"model_path": str(checkpoints.a), "weight_version": "A"},
            token=TOKEN,
        )
        assert status == 200, body
    gateway.wait_for(lambda rows: [r["weight_version"] for r in rows] == ["A", "A"], timeout=5)
    fault = FaultStubs(victim)
    with Rollouts(gateway, victim.served_model) as rollouts:
        rollouts.wait_for(6, after=0.0)
        child, name = stalled_stream(victim, fault, checkpoints.file("B"), WRITTEN_BYTES)
        child.close()  # the trainer dies mid-stream: tensors were written
        failed_at = time.monotonic()
        op = fault.finished(name)
        assert op.error.code != 0 and not fault.version().declared
        out = gateway.wait_for(
            lambda rows: any(
                r["url"].endswith(victim.grpc_target.rsplit(":", 1)[1]) and r["health"] != "ready" for r in rows
            ),
            timeout=10,
        )
        left_after = time.monotonic() - failed_at
        assert left_after <= 2 * HEALTH_INTERVAL_S + 2.0, (left_after, out)
        assert _row(gateway, victim)["weight_version"] == ""  # cleared, never a stale "A"

        # vLLM's /resume name cannot lift the pause a partial update holds.
        status, body = call(victim.http_url, "/resume", {}, token=TOKEN)
        assert (status, body["error"]) == (412, "PARTIAL_UPDATE")
        assert fault.state().paused

        out_at = time.monotonic()
        done_before = _requests_done(victim)
        rollouts.wait_for(12, after=out_at)
        window = [(t, fp) for t, fp in rollouts.answers if t > out_at]
        assert _requests_done(victim) == done_before  # none of these came from the victim
        assert {fp for _, fp in window} == {"A"}  # every one stamped by the other server
        print(
            f"out of rotation {left_after:.2f}s after the failure; {len(window)} rollouts served meanwhile, all by the other server"
        )

        # A successful update ends the quarantine; SMG routes to the server again.
        status, body = call(
            victim.http_url,
            "/update_weights_from_disk",
            {"model_path": str(checkpoints.a), "weight_version": "A"},
            token=TOKEN,
        )
        assert status == 200, body
        repaired = time.monotonic()
        gateway.wait_for(
            lambda rows: all(r["health"] == "ready" and r["weight_version"] == "A" for r in rows), timeout=10
        )
        back_after = time.monotonic() - repaired
        done_before = _requests_done(victim)
        deadline = time.monotonic() + 60
        while _requests_done(victim) <= done_before:
            assert time.monotonic() < deadline, "SMG never routed to the repaired server"
            rollouts.wait_for(1, after=time.monotonic())
        print(f"back in rotation {back_after:.2f}s after the repair")
    assert not rollouts.errors, rollouts.errors
    assert other.pid and Path(f"/proc/{other.pid}").exists()
