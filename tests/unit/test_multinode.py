"""The head's decisions for an engine whose ranks span hosts (docs/multinode.md), without an
engine: which address the relay and the channels listen on (server/flags.py), what the head
refuses before serving (server/wiring.py `configure_ranks`), and when a remote rank counts as
dead (server/rank_watch.py, on a real FpmRelay with a clock the test turns).

The engine here is a stand-in that answers CONFIGURE as told: the real answers cross
namespaces in tests/e2e/multinode/.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import pytest

from enginectl.common.host import HostIdentity
from enginectl.contract.census import RankCensus, RankConfigured, WorkerCensus
from enginectl.contract.engine import RankFailure
from enginectl.contract.engine_config import EngineConfig, frame_key
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.server.census import Census
from enginectl.server.flags import _multinode_config, build_parser
from enginectl.server.fpm.relay import FpmRelay
from enginectl.server.rank_watch import RankWatch
from enginectl.server.wiring import StartupError, configure_ranks
from enginectl.server.worker_calls import RankOutcome

HEAD = HostIdentity("boot-a", "head")
NODE_B = HostIdentity("boot-b", "node-b")
KEY = frame_key("0123456789abcdef", "ab" * 16)


# -- flags ----------------------------------------------------------------------------------
def multinode(*argv: str) -> tuple[str | None, float]:
    config = _multinode_config(build_parser().parse_args(["serve", *argv]))
    return config.channel_address, config.liveness_timeout_s


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], (None, 10.0)),  # one host: ipc:// only
        (["--data-parallel-size", "2"], (None, 10.0)),  # every rank local
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "10.0.0.1"],
            ("10.0.0.1", 10.0),
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "10.0.0.1"]
            + ["--channel-address", "192.168.1.5", "--liveness-timeout", "30"],
            ("192.168.1.5", 30.0),
        ),
        (
            [
                "--data-parallel-size",
                "4",
                "--data-parallel-size-local",
                "2",
                "--data-parallel-hybrid-lb",
                "--data-parallel-address",
                "10.0.0.1",
            ],
            (None, 10.0),
        ),
    ],
    ids=["one-host", "dp-local", "dp-address", "channel-address", "hybrid-lb"],
)
def test_the_channels_listen_for_other_nodes_only_when_ranks_may_run_there(
    argv: list[str], expected: tuple[str | None, float]
) -> None:
    assert multinode(*argv) == expected


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--data-parallel-size", "2", "--data-parallel-size-local", "1"], "need --data-parallel-address"),
        (["--liveness-timeout", "2"], "at least 3 times --fpm-heartbeat-interval"),
    ],
    ids=["no-address", "bound-below-heartbeats"],
)
def test_flags_that_can_not_work_across_nodes_are_refused(argv: list[str], why: str) -> None:
    with pytest.raises(SystemExit, match=why):
        multinode(*argv)


# -- configure_ranks ------------------------------------------------------------------------
def census(*hosts: HostIdentity) -> Census:
    ranks = [
        RankOutcome(
            r,
            RankCensus(
                dp_rank=r,
                enginectl_version="1.0",
                enginectl_scheduler=True,
                scheduler="enginectl",
                hostname=h.hostname,
                boot_id=h.boot_id,
                pid=100 + r,
                workers=[WorkerCensus(r, 0, h.hostname, h.boot_id, "1.0")],
            ),
        )
        for r, h in enumerate(hosts)
    ]
    return Census(ranks, "1.0", HEAD)


class Ranks:
    """Answers CONFIGURE for each rank as `answer(dp_rank, config)` says; counts the calls."""

    def __init__(self, answer: object = None) -> None:
        self.calls: list[EngineConfig] = []
        self._answer = answer

    async def configure(self, config: EngineConfig, timeout: float) -> Sequence[RankOutcome[RankConfigured]]:
        self.calls.append(config)
        out = []
        for r in range(2):
            if callable(self._answer):
                out.append(self._answer(r, config))
            else:
                out.append(RankOutcome(r, RankConfigured(r, config.digest(), config.fpm_tcp_endpoint)))
        return out


def config(tcp: str = "tcp://10.0.0.1:5555") -> EngineConfig:
    return EngineConfig(
        fpm_endpoint="ipc:///tmp/x/fpm.sock",
        fpm_tcp_endpoint=tcp,
        head_hostname=HEAD.hostname,
        head_boot_id=HEAD.boot_id,
        channel_secret="ab" * 16,
        incarnation="0123456789abcdef",
    )


async def test_every_rank_holding_the_starts_config_serves() -> None:
    ranks = Ranks()
    await configure_ranks(ranks, census(HEAD, NODE_B), config())  # type: ignore[arg-type]
    assert len(ranks.calls) == 1


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (
            config("tcp://127.0.0.1:5555"),
            "rank 1 (host node-b): this head listens for it on tcp://127.0.0.1:5555, a loopback",
        ),
        (config(""), "rank 1 (host node-b) runs on another host, but this head expects every rank on its own"),
    ],
    ids=["loopback", "not-expected"],
)
async def test_a_remote_rank_this_head_can_not_be_reached_from_is_refused_before_configure(
    sent: EngineConfig, why: str
) -> None:
    ranks = Ranks()
    with pytest.raises(StartupError, match=re.escape(why)):
        await configure_ranks(ranks, census(HEAD, NODE_B), sent)  # type: ignore[arg-type]
    assert ranks.calls == []  # nothing was sent


async def test_a_rank_that_holds_another_config_or_does_not_answer_is_named() -> None:
    def answer(r: int, sent: EngineConfig) -> RankOutcome[RankConfigured]:
        if r == 0:
            return RankOutcome(0, RankConfigured(0, "something-else", ""))
        return RankOutcome(1, failure=RankFailure.RANK_TIMEOUT, message="no answer in 5.0s")

    with pytest.raises(StartupError) as refused:
        await configure_ranks(Ranks(answer), census(HEAD, NODE_B), config())  # type: ignore[arg-type]
    assert "rank 0: holds config something-else" in str(refused.value)
    assert "rank 1: CONFIGURE failed (no answer in 5.0s)" in str(refused.value)


# -- RankWatch ------------------------------------------------------------------------------
class Clock:
    """The watch's clock: this process's monotonic clock (which the relay stamps arrivals
    with) plus `ahead` seconds, so the test moves time forward without waiting for it."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def heartbeat(dp_rank: int) -> bytes:
    sample = fpm_pb2.ForwardPassMetrics(
        schema_version=1, worker_id="w", dp_rank=dp_rank, incarnation="x", kind=fpm_pb2.SAMPLE_KIND_HEARTBEAT
    )
    return KEY + sample.SerializeToString()


def test_a_remote_rank_is_dead_once_silent_past_the_bound_and_only_then() -> None:
    relay = FpmRelay(incarnation="x", key=KEY)
    clock = Clock()
    clock.ahead = -9.0  # the watch starts 9 s before now
    watch = RankWatch(relay, {1: "node-b"}, bound_s=10.0, lost=lambda cause: None, clock=clock)
    clock.ahead = 0.0
    assert watch.silent() is None  # 9 s without a word: not yet, the bound counts from the watch's start
    relay.prepare([heartbeat(1)])  # rank 1 speaks now
    clock.ahead = 9.0
    assert watch.silent() is None  # it spoke 9 s ago (18 s after the watch's start)
    relay.prepare([b"not keyed" + heartbeat(1)[len(KEY) :]])  # a stranger speaking for rank 1
    relay.prepare([heartbeat(0)])  # rank 0 is local: not watched here
    clock.ahead = 10.5
    found = watch.silent()
    assert found is not None and found[:2] == (1, "node-b") and found[2] == pytest.approx(10.5, abs=0.5)
