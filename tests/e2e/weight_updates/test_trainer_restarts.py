"""A trainer that restarts takes over what its predecessor held (docs/weights.md, "A trainer
that restarts"): here, an update group, on the session's weights server.

The predecessor is a real process (tests/support/group_trainer_proc.py) killed with os._exit
right after InitWeightsUpdateGroup: the engine's workers are still members of a group whose
rank 0 is gone. Its successor, another process that knows nothing of it, creates the group
under the same name and broadcasts an update through it, with no call in between. The
vLLM-API trainer's takeover of the transfer engine is in test_transfer_engine.py, the fleet's
repair from a fresh process in tests/e2e/test_fleet.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints, greedy_tokens, takeovers

from enginectl.client import TrainerClient
from enginectl.client.errors import FailedPreconditionError
from enginectl.weights.v1 import weight_version_pb2 as wv
from enginectl.weights.v1 import weight_version_service_pb2 as vpb

GROUP_TRAINER = Path(__file__).parents[2] / "support" / "group_trainer_proc.py"


def run_trainer(server: ServeProcess, file: Path, mode: str, group: str, *version: str) -> dict[str, Any]:
    """tests/support/group_trainer_proc.py in its own process: its one JSON line."""
    proc = subprocess.run(
        [sys.executable, str(GROUP_TRAINER), server.grpc_target, str(file), mode, group, *version],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == (0 if mode == "full" else 1), proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_group_whose_trainer_died_is_created_again_by_name_and_feeds_an_update(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int], tokens_b: list[int]
) -> None:
    died = run_trainer(weights_server, checkpoints.file("B"), "die", "restarting")
    assert died["group"] == "restarting"
    assert greedy_tokens(weights_server) == tokens_a  # the dead trainer's group changed nothing
    counted = takeovers(weights_server, "update_group")

    done = run_trainer(weights_server, checkpoints.file("B"), "full", "restarting", "G-successor")
    assert done == {"version": "G-successor", "ranks": 1}
    version = stubs.version()
    assert (version.declared, version.version, version.source) == (
        True,
        "G-successor",
        wv.WEIGHT_SOURCE_DISTRIBUTED,
    )
    assert greedy_tokens(weights_server) == tokens_b
    assert stubs.verify(full=True).verdict == vpb.VERIFY_VERDICT_MATCH
    assert takeovers(weights_server, "update_group") == counted + 1
    taken = [e for e in weights_server.events() if e.get("event") == "update group taken over"]
    assert taken and taken[-1]["group"] == "restarting", taken
    assert taken[-1]["previous_caller"].startswith("ipv") and taken[-1]["previous_create_time"]


def test_a_group_an_update_receives_through_is_not_taken_and_the_refusal_names_the_update(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints, tokens_a: list[int]
) -> None:
    """While an update receives through the group, a second trainer's init under its name is
    refused FAILED_PRECONDITION GROUP_IN_USE naming the update, whose CancelOperation frees
    the name; nothing was written."""
    before = stubs.version()
    with TrainerClient(weights_server.grpc_target, timeout=120.0) as first:
        first.init_weights_update_group("held", timeout=60.0)
        broadcast = first.start_broadcast(checkpoints.state_dict("B"), "never", group_name="held", timeout=120.0)
        with TrainerClient(weights_server.grpc_target, timeout=120.0) as second:
            with pytest.raises(FailedPreconditionError) as refused:
                second.init_weights_update_group("held", timeout=30.0)
        assert refused.value.reason == "GROUP_IN_USE"
        assert refused.value.metadata["operation"] == broadcast.name
        assert f"CancelOperation(name={broadcast.name!r})" in refused.value.message
        first.cancel_operation(broadcast.name)
        ended = first.wait_operation(broadcast.name, 60.0)
        assert ended.done and ended.error is not None and ended.error.reason == "UPDATE_CANCELLED", ended
    after = stubs.version()
    assert (after.version, after.etag) == (before.version, before.etag)
    assert greedy_tokens(weights_server) == tokens_a
