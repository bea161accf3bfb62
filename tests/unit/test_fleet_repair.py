"""What Fleet.repair does, decided from the servers' state alone (client/fleet_repair.py), and
how `enginectl fleet status` shows what a repair reads (cli/fleet.py).

Plain FleetStatus values, as `Fleet.status()` reads them from real servers after the failures
tests/e2e/test_fleet.py causes; the e2e tests run the repairs themselves.
"""

from __future__ import annotations

import grpc
import pytest

from enginectl.cli.fleet import _status_view
from enginectl.client.errors import EnginectlError
from enginectl.client.fleet_repair import Repair, RepairUnclear, repair_version, repairs
from enginectl.client.fleet_types import FleetStatus, ServerStatus
from enginectl.client.trainer_types import GenerationState, StagedWeights
from enginectl.client.types import UpdateFailure, WeightSource, WeightVersion


def version(name: str | None, failed: str | None = None) -> WeightVersion:
    failure = None if failed is None else UpdateFailure("PARTIAL_UPDATE", "x", None, failed, "operations/1")
    return WeightVersion(name is not None, name, 1, "inc", f"etag-{name}", WeightSource.DISK, None, failure)


def staged(name: str | None) -> StagedWeights:
    return StagedWeights("staged/s", "operations/s", "DISK", name, 3, 30, "d", "staged-crc32", None)


def server(
    target: str, name: str | None, *, paused: bool = False, failed: str | None = None, holds: str | None | bool = False
) -> ServerStatus:
    reason = ("PARTIAL_UPDATE" if failed else "CALLER") if paused else "UNSPECIFIED"
    generation = GenerationState(
        paused, reason, "KEEP" if paused else "UNSPECIFIED", 0, 0, "", (), None if holds is False else staged(holds)
    )  # type: ignore[arg-type]
    return ServerStatus(target, not paused and failed is None, version(name, failed), generation)


def fleet(*servers: ServerStatus) -> FleetStatus:
    return FleetStatus({s.target: s for s in servers})


def test_a_quarantined_server_is_recommitted_to_the_version_its_failure_attempted() -> None:
    status = fleet(server("x", "v2"), server("y", None, paused=True, failed="v2", holds="v2"))
    assert status.servers["y"].quarantined and not status.servers["x"].quarantined
    assert repair_version(status) == "v2"
    assert repairs(status, "v2") == {"y": Repair("y", "commit", staged="staged/s")}


def test_a_held_server_commits_its_set_and_one_left_paused_on_the_version_resumes() -> None:
    """Fenced out (held paused on its old version, its set kept), and one whose commit went
    through before the trainer died without lifting the fleet's barrier pause."""
    status = fleet(
        server("x", "v2", paused=True),
        server("y", "someone-else", paused=True, holds="v2"),
        server("z", "v2"),
    )
    assert repair_version(status) == "v2"
    assert repairs(status, "v2") == {"x": Repair("x", "resume"), "y": Repair("y", "commit", staged="staged/s")}


def test_a_server_without_the_right_set_is_named_not_repaired() -> None:
    status = fleet(server("x", "v2"), server("y", None, failed="v2"), server("z", "v1", paused=True, holds="v3"))
    plan = repairs(status, "v2")
    assert plan["y"].action == "" and "nothing staged" in plan["y"].why
    assert plan["z"].action == "" and "'v3'" in plan["z"].why and "x" not in plan


def test_servers_that_name_two_versions_are_refused_and_a_consistent_fleet_names_its_own() -> None:
    with pytest.raises(RepairUnclear, match="v2, v3"):
        repair_version(fleet(server("x", None, failed="v2", holds="v2"), server("y", None, failed="v3", holds="v3")))
    assert repair_version(fleet(server("x", "v1", holds="v1"), server("y", "v1"))) == "v1"
    with pytest.raises(RepairUnclear, match="none"):
        repair_version(fleet(server("x", None, failed="")))


def test_an_unreadable_server_is_named() -> None:
    gone = ServerStatus("y", False, error=EnginectlError(grpc.StatusCode.UNAVAILABLE, "down"))
    plan = repairs(fleet(server("x", "v2"), gone), "v2")
    assert plan == {"y": Repair("y", "", why="could not be read: UNAVAILABLE: down")}


def test_fleet_status_on_a_terminal_marks_the_quarantine_and_what_the_server_holds() -> None:
    shown = _status_view(fleet(server("x", "v2"), server("y", None, paused=True, failed="v2", holds="v2")))
    assert "QUARANTINED" in shown and "NOT consistent" in shown
    assert "last failure: PARTIAL_UPDATE in operations/1 (attempted 'v2')" in shown
    assert "staged set: staged/s (version 'v2'), still staging" in shown
