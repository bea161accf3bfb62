"""FleetView.reconcile: the verdict rules, on samples built directly and a controllable clock
(pure logic: no server involved; the planner's streams are tested in tests/e2e/test_planner.py)."""

from __future__ import annotations

import pytest

from enginectl.client import FleetView, FpmSample, Verdict
from enginectl.client.fpm import QueuedRequests, SampleKind, ScheduledRequests


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(worker_id: str, dp_rank: int = 0, sequence: int = 1) -> FpmSample:
    return FpmSample(
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=sequence,
        identity_generation=1,
        incarnation="inc",
        emit_time=None,
        wall_time=0.0,
        idle=True,
        kind=SampleKind.HEARTBEAT,
        scheduled=ScheduledRequests(0, 0, 0.0, 0, 0, 0, 0.0),
        queued=QueuedRequests(0, 0, 0.0, 0, 0, 0.0),
        kv_cache_usage=0.0,
        num_running=0,
        num_waiting=0,
        dropped_since_last=0,
        sequence=sequence,
        weight_revision=0,
        schema_version=1,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(clock: Clock) -> FleetView:
    return FleetView(clock)


def test_no_samples_is_no_fpm_data(fleet: FleetView) -> None:
    assert fleet.reconcile({"a"}, 1).verdict is Verdict.NO_FPM_DATA


def test_only_unattributed_samples_is_no_fpm_data_with_their_count(fleet: FleetView) -> None:
    fleet.record("e1", sample(""))
    fleet.record("e1", sample("stranger"))
    verdict = fleet.reconcile({"a"}, 1)
    assert verdict.verdict is Verdict.NO_FPM_DATA and verdict.unattributed == {"e1": 2}
    assert "e1" in verdict.detail


def test_full_fresh_coverage_is_ok(fleet: FleetView) -> None:
    for endpoint, worker in (("e1", "a"), ("e2", "b")):
        for rank in (0, 1):
            fleet.record(endpoint, sample(worker, rank))
    verdict = fleet.reconcile({"a", "b"}, 2)
    assert verdict.ok and verdict.workers == {"a": (0, 1), "b": (0, 1)}
    assert verdict.unattributed == {"e1": 0, "e2": 0}


def test_an_unattributed_worker_is_a_count_mismatch_with_its_endpoint_count(fleet: FleetView) -> None:
    fleet.record("e1", sample("a"))
    for i in range(3):
        fleet.record("e2", sample("", sequence=i + 1))
    verdict = fleet.reconcile({"a", "b"}, 1)
    assert verdict.verdict is Verdict.WORKER_COUNT_MISMATCH
    assert verdict.unattributed == {"e1": 0, "e2": 3}
    assert [(r.endpoint, r.worker_id) for r in verdict.unattributed_ranks] == [("e2", "")]


def test_a_rank_that_gets_its_identity_stops_being_unattributed(fleet: FleetView) -> None:
    fleet.record("e1", sample("a"))
    fleet.record("e2", sample(""))
    fleet.record("e2", sample("b", sequence=2))  # same rank, identity now set
    verdict = fleet.reconcile({"a", "b"}, 1)
    assert verdict.ok and not verdict.unattributed_ranks and verdict.unattributed["e2"] == 1


def test_unequal_rank_counts_are_inconsistent(fleet: FleetView) -> None:
    fleet.record("e1", sample("a", 0))
    fleet.record("e1", sample("a", 1))
    fleet.record("e2", sample("b", 0))
    assert fleet.reconcile({"a", "b"}, 2).verdict is Verdict.INCONSISTENT_DP_RANKS


def test_missing_ranks_are_incomplete_coverage(fleet: FleetView) -> None:
    fleet.record("e1", sample("a", 0))
    fleet.record("e2", sample("b", 0))
    verdict = fleet.reconcile({"a", "b"}, 2)
    assert verdict.verdict is Verdict.INCOMPLETE_COVERAGE and "[0, 1]" in verdict.detail


def test_a_quiet_rank_is_stale_after_the_window_only(fleet: FleetView, clock: Clock) -> None:
    fleet.record("e1", sample("a"))
    fleet.record("e2", sample("b"))
    clock.now += 4.0
    fleet.record("e1", sample("a", sequence=2))
    assert fleet.reconcile({"a", "b"}, 1, stale_after=5.0).ok
    clock.now += 1.5
    verdict = fleet.reconcile({"a", "b"}, 1, stale_after=5.0)
    assert verdict.verdict is Verdict.STALE
    assert [(r.endpoint, r.worker_id, round(r.age_s, 1)) for r in verdict.stale] == [("e2", "b", 5.5)]


def test_forgetting_an_endpoint_keeps_its_counts(fleet: FleetView) -> None:
    fleet.record("e1", sample("a"))
    fleet.forget("e1")
    assert fleet.latest() == [] and fleet.sample_counts("e1") == {"a": 1}


def test_latest_filters_to_known_workers_with_ages(fleet: FleetView, clock: Clock) -> None:
    fleet.record("e1", sample("a", 0))
    clock.now += 2.0
    fleet.record("e1", sample("a", 1))
    fleet.record("e2", sample("", 0))
    known = fleet.latest({"a"})
    assert [(r.endpoint, r.worker_id, r.dp_rank, r.age_s) for r in known] == [("e1", "a", 0, 2.0), ("e1", "a", 1, 0.0)]
    assert len(fleet.latest()) == 3
