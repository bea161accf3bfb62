"""enginectl's gloo broadcast registered as one of vLLM's weight-transfer engines, driven by a
trainer written against vLLM's own trainer-side API and its own HTTP client
(`HTTPVLLMWeightSyncClient`), as SkyRL- or prime-rl-style trainers call it (docs/weights.md,
"vLLM's weight-transfer engines").

The session's weights server runs with `--weight-transfer-config '{"backend": "gloo"}'`;
vLLM's four routes are enginectl's there (docs/http_routes.md), so each round is an enginectl
update: the version recorded with its source, the prefix cache reset, generation paused for
the round and resumed, a failed round leaving the weights whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from google.longrunning import operations_pb2
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens, takeovers
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from enginectl.client.transfer_engine import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    StateDictSource,
    register,
)
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

TRAINER_PROC = Path(__file__).parents[2] / "support" / "transfer_trainer_proc.py"


def wait_for_failed_round(stubs: Stubs, name: str) -> Any:
    done = stubs.ops.WaitOperation(operations_pb2.WaitOperationRequest(name=name), timeout=60)
    assert done.done and done.HasField("error"), done
    return done


def run_trainer(server: ServeProcess, file: str, mode: str, *version: str) -> dict[str, Any]:
    """tests/support/transfer_trainer_proc.py in its own process: its one JSON line."""
    proc = subprocess.run(
        [sys.executable, str(TRAINER_PROC), server.http_url, file, mode, *version],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == (0 if mode == "full" else 1), proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_trainer_killed_mid_round_leaves_the_weights_untouched_and_its_successor_takes_over(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], tokens_b: list[int]
) -> None:
    """The trainer dies between start and finish, after half the tensors went out: the workers'
    receive fails on the closed connection, the round ends without touching the model (the
    engine serves A, whole). A new trainer process, written as vLLM's examples write one, then
    calls init first with no other call before it: its init takes the dead trainer's
    connection over (docs/weights.md, "A trainer that restarts"), logged and counted, and its
    round applies B under the version it names."""
    before = stubs.version()
    died = run_trainer(weights_server, str(checkpoints.file("B")), "die")
    assert died["sent"] > 0
    failed = wait_for_failed_round(stubs, died["operation"])
    assert "TRANSFER_FAILED" in str(failed.error), failed.error
    after = stubs.version()
    assert (after.version, after.etag) == (before.version, before.etag)  # not partial: nothing written
    assert not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH

    counted = takeovers(weights_server, "transfer_engine")
    run_trainer(weights_server, str(checkpoints.file("B")), "full", "T-successor")
    assert greedy_tokens(weights_server) == tokens_b
    version = stubs.version()
    assert (version.declared, version.version, version.source) == (
        True,
        "T-successor",
        wv.WEIGHT_SOURCE_TRANSFER_ENGINE,
    )
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH
    assert takeovers(weights_server, "transfer_engine") == counted + 1
    taken = [e for e in weights_server.events() if e.get("event") == "transfer engine taken over"]
    assert taken and taken[-1]["previous_caller"].startswith("http:127.0.0.1:"), taken
    assert taken[-1]["previous_init_time"] and taken[-1]["caller"].startswith("http:127.0.0.1:")


@pytest.mark.parametrize(
    ("path", "body", "status", "reason"),
    [
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}}, 400, "TRANSFER_INIT_INVALID"),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}},
            400,
            "TRANSFER_INIT_INVALID",
        ),
        (
            "/update_weights",
            {"update_info": {"names": ["x"], "dtype_names": [], "shapes": []}},
            412,
            "TRANSFER_NOT_STARTED",
        ),
        ("/finish_weight_update", None, 412, "TRANSFER_NOT_STARTED"),
    ],
    ids=["init-missing-fields", "init-rank-offset-0", "update-before-start", "finish-before-start"],
)
def test_bad_four_step_calls_are_refused_and_change_nothing(
    weights_server: ServeProcess,
    stubs: Stubs,
    tokens_a: list[int],
    path: str,
    body: dict[str, Any] | None,
    status: int,
    reason: str,
) -> None:
    """Malformed init info (refused by the engine's own parse, before any worker connects) and
    steps out of order: each its reason, the engine serving the same weights."""
    before = stubs.version()
    response = requests.post(f"{weights_server.http_url}{path}", json=body, timeout=60)
    assert (response.status_code, response.json()["error"]) == (status, reason), response.text
    assert stubs.version() == before and not stubs.state().paused
    assert greedy_tokens(weights_server) == tokens_a
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH


@pytest.fixture(scope="module")
def trainer(weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints) -> Iterator[Any]:
    """vLLM's trainer-side factory builds enginectl's gloo engine: rank 0 of a group with the
    server's workers, joined through vLLM's /init_weight_transfer_engine."""
    register()
    workers = stubs.updates.GetServerInfo(upb.GetServerInfoRequest(), timeout=10).num_workers
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0, timeout_s=30.0),
        client=HTTPVLLMWeightSyncClient(weights_server.http_url, timeout=60),
        source=StateDictSource(checkpoints.state_dict("B")),
    )
    assert isinstance(engine, GlooTrainerWeightTransferEngine)
    yield engine
    engine.shutdown()
    HTTPVLLMWeightSyncClient(weights_server.http_url).shutdown_weight_transfer_engine()


def test_vllm_trainer_api_updates_through_the_gloo_engine(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int], tokens_b: list[int]
) -> None:
    """vLLM's HTTP client's finish_weight_update(version) declares it through the ledger."""
    trainer.send_weights(weight_version="H-1")
    version = stubs.version()
    assert (version.declared, version.version, version.source) == (True, "H-1", wv.WEIGHT_SOURCE_TRANSFER_ENGINE)
    assert greedy_tokens(weights_server) == tokens_b  # enginectl reset the prefix cache
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_MATCH
    assert not stubs.state().paused


def test_a_round_without_a_version_leaves_the_weights_undeclared(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int], tokens_b: list[int]
) -> None:
    """vLLM's trainer engines finish without a version: new weights never keep an old label."""
    trainer.send_weights()
    assert not stubs.version().declared
    assert stubs.verify().verdict == vpb.VERIFY_VERDICT_UNDECLARED
    assert greedy_tokens(weights_server) == tokens_b


def test_a_second_round_reuses_the_group(
    weights_server: ServeProcess, stubs: Stubs, trainer: Any, tokens_a: list[int], tokens_b: list[int]
) -> None:
    """Rounds repeat over one group (its receive buffers reused); the update info is vLLM's
    NCCL engine's fields plus the bucket size."""
    info = trainer.update_info()
    assert set(info) == {"names", "dtype_names", "shapes", "bucket_bytes"}
    assert len(info["names"]) == len(info["shapes"]) > 0
    for round_ in range(2):
        trainer.send_weights(weight_version=f"H-{round_}")
        assert greedy_tokens(weights_server) == tokens_b
        assert stubs.version().version == f"H-{round_}"
