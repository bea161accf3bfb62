"""Rank ranges (client/rank_ranges.py, server/engine_info.py): which DP ranks a server manages
under vLLM's hybrid load balancing, the broadcast group's windows over a fleet's workers, how
an engine's servers cover its ranks, and what a planner expects per worker id. Pure
arithmetic, on real vLLM ParallelConfigs and GetServerInfo answers built as a server builds
them; the two-node runs are tests/e2e/multinode/test_hybrid_lb.py."""

from __future__ import annotations

import itertools
import random

import pytest
from vllm.config import ParallelConfig

from enginectl.client import FleetView, Verdict
from enginectl.client.rank_ranges import ExpectedRanks, engine_coverage, expected_ranks, group_windows
from enginectl.client.trainer_types import ServerInfo
from enginectl.server.engine_info import EngineInfo, managed_ranks, shared_engine_id
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from tests.unit.test_planner_fleet import Clock, sample


def hybrid(size: int, local: int, start: int, head: str = "10.0.0.1", port: int = 29550) -> ParallelConfig:
    """vLLM's parallel config of one node's API server under `--data-parallel-hybrid-lb`."""
    return ParallelConfig(
        data_parallel_size=size,
        data_parallel_size_local=local,
        data_parallel_rank=start,
        data_parallel_hybrid_lb=True,
        data_parallel_master_ip=head,
        data_parallel_rpc_port=port,
    )


def info(size: int, start: int, count: int, engine: str, tp: int = 1, incarnation: str = "") -> ServerInfo:
    """A GetServerInfo answer of a server managing ranks start..start+count-1 of `size`."""
    msg = pb2.GetServerInfoResponse(
        data_parallel_size=size, tensor_parallel_size=tp, num_workers=count * tp, engine_id=engine
    )
    msg.managed_ranks.start, msg.managed_ranks.count = start, count
    msg.incarnation = incarnation or f"inc-{engine}-{start}"
    return ServerInfo.from_proto(msg)


# -- which ranks a server manages (server/engine_info.py) ----------------------------------


def test_each_node_of_a_hybrid_engine_manages_its_own_ranks_and_shares_the_engine_id() -> None:
    nodes = [hybrid(8, 2, start) for start in (0, 2, 4, 6)]
    ranges = [managed_ranks(p) for p in nodes]
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert sorted(itertools.chain.from_iterable(ranges)) == list(range(8))  # they tile the engine
    ids = {shared_engine_id(p) for p in nodes}
    assert len(ids) == 1 and ids != {""}
    assert shared_engine_id(hybrid(8, 2, 0, head="10.0.0.9")) not in ids  # another engine


def test_a_server_without_hybrid_lb_manages_every_rank_even_those_of_other_nodes() -> None:
    assert managed_ranks(ParallelConfig()) == range(1)
    spanning = ParallelConfig(data_parallel_size=2, data_parallel_size_local=1)  # DESIGN §13: rank 1 headless
    assert managed_ranks(spanning) == range(2)
    assert shared_engine_id(spanning) == ""  # its incarnation names its engine


def test_the_servers_layout_and_workers_are_those_of_its_ranks() -> None:
    engine = EngineInfo("m", ("m",), "float32", "", 4, 2, 1, "0", managed_ranks=range(2, 4), engine_id="e")
    assert engine.num_workers == 4
    assert (engine.layout.ranks, engine.layout.workers_per_rank, engine.layout.first_rank) == (2, 2, 2)
    assert engine.layout.first_worker == 4 and list(engine.layout.dp_ranks) == [2, 3]
    whole = EngineInfo("m", ("m",), "float32", "", 4, 2, 1, "0")
    assert whole.managed_ranks == range(4) and whole.num_workers == 8 and whole.layout.first_worker == 0


# -- broadcast group windows ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_windows_tile_the_group_after_the_trainer_and_none_overlaps(seed: int) -> None:
    rng = random.Random(seed)
    workers = {f"s{i}": rng.randint(0, 6) for i in range(rng.randint(1, 6))}
    windows, world = group_windows(workers)
    ranks = sorted(itertools.chain.from_iterable(windows.values()))
    assert ranks == list(range(1, world))  # every rank but the trainer's 0, each once
    assert [len(windows[t]) for t in workers] == list(workers.values())
    assert list(windows) == list(workers)  # server after server, in the fleet's order
    for a, b in itertools.pairwise(windows.values()):
        assert a.stop == b.start


def test_a_fleet_of_a_hybrid_engines_two_servers_takes_four_ranks_not_eight() -> None:
    """The windows come from the workers each server manages: from the engine's global size
    the two windows would overlap and the group would wait for ranks nobody takes."""
    infos = {"node-a": info(4, 0, 2, "e"), "node-b": info(4, 2, 2, "e")}
    windows, world = group_windows({t: i.num_workers for t, i in infos.items()})
    assert windows == {"node-a": range(1, 3), "node-b": range(3, 5)} and world == 5


def test_a_negative_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="s0"):
        group_windows({"s0": -1})


# -- how an engine's servers cover its ranks ------------------------------------------------


def test_two_nodes_of_one_engine_cover_it_and_independent_servers_are_engines_of_their_own() -> None:
    covers = engine_coverage(
        {"a": info(4, 0, 2, "e"), "b": info(4, 2, 2, "e"), "solo": info(2, 0, 2, "", incarnation="solo-inc")}
    )
    assert {c.engine_id: (c.ok, c.dp_size, sorted(c.servers)) for c in covers} == {
        "e": (True, 4, ["a", "b"]),
        "solo-inc": (True, 2, ["solo"]),
    }


def test_a_gap_an_overlap_and_a_size_disagreement_are_named() -> None:
    (gap,) = engine_coverage({"a": info(6, 0, 2, "e"), "b": info(6, 4, 2, "e")})
    assert gap.gaps == (2, 3) and "ranks [2, 3] of 6 are managed by no server" in gap.describe()
    (overlap,) = engine_coverage({"a": info(4, 0, 3, "e"), "b": info(4, 2, 2, "e")})
    assert overlap.overlaps == {2: ("a", "b")} and "rank 2 is managed by 2 servers (a, b)" in overlap.describe()
    (sizes,) = engine_coverage({"a": info(4, 0, 2, "e"), "b": info(6, 2, 4, "e")})
    assert sizes.sizes == {"a": 4, "b": 6} and not sizes.ok


# -- what a planner expects ------------------------------------------------------------------


def test_expected_ranks_per_worker_id_from_the_servers_ranges() -> None:
    a, b = info(4, 0, 2, "e"), info(4, 2, 2, "e")
    one_id = expected_ranks({"a": ("w", a), "b": ("w", b)})
    assert one_id.by_worker == {"w": (0, 1, 2, 3)} and one_id.problems == ""
    per_node = expected_ranks({"a": ("wa", a), "b": ("wb", b)})
    assert per_node.by_worker == {"wa": (0, 1), "wb": (2, 3)}


def test_reconcile_judges_each_worker_on_its_own_ranks() -> None:
    fleet = FleetView(Clock())
    expected = expected_ranks({"a": ("wa", info(4, 0, 2, "e")), "b": ("wb", info(4, 2, 2, "e"))})
    for endpoint, worker, ranks in (("a", "wa", (0, 1)), ("b", "wb", (2,))):
        for rank in ranks:
            fleet.record(endpoint, sample(worker, rank))
    judged = fleet.reconcile(expected)
    assert judged.verdict is Verdict.INCOMPLETE_COVERAGE and "'wb': [2, 3]" in judged.detail, judged.detail
    fleet.record("b", sample("wb", 3))
    assert fleet.reconcile(expected).verdict is Verdict.OK
    # A plain mapping works alike; the worker-ids-and-size form keeps its meaning.
    assert fleet.reconcile({"wa": [0, 1], "wb": [2, 3]}).verdict is Verdict.OK
    assert fleet.reconcile({"wa", "wb"}, 4).verdict is Verdict.INCOMPLETE_COVERAGE  # each on all 4 ranks


def test_reconcile_names_a_gap_between_the_servers_ranges_before_anything_else() -> None:
    fleet = FleetView(Clock())
    fleet.record("a", sample("w", 0))
    broken = expected_ranks({"a": ("w", info(4, 0, 2, "e")), "b": ("w", info(4, 3, 1, "e"))})
    judged = fleet.reconcile(broken)
    assert judged.verdict is Verdict.RANK_RANGES_INVALID
    assert "ranks [2] of 4 are managed by no server" in judged.detail


def test_reconcile_with_worker_ids_needs_a_dp_size() -> None:
    with pytest.raises(TypeError, match="dp_size"):
        FleetView(Clock()).reconcile({"w"})
    assert isinstance(expected_ranks({}), ExpectedRanks)
