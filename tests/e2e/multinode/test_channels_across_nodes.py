"""Tier 0: enginectl's own channels between the head (this process) and node B
(bench/lib/two_node.py), with no vLLM engine: seconds each (docs/multinode.md).

- the FPM relay, bound as `enginectl serve` binds it when ranks span hosts (ipc:// and TCP on
  the head's address, keyed), and a rank's real FpmPublisher on node B configured as CONFIGURE
  configures it (contract/engine_config.py): its samples arrive, a stranger's unkeyed frames
  are dropped and counted, and once the relay is gone the publisher reports its head lost;
- an update's channels with rank 1 on node B: its worker's data and progress cross over TCP
  (rank 0's stay on `ipc://`), every message keyed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio
from support.two_node import TwoNodes, two_nodes

from enginectl.contract.engine import Cause, LoadPlan, Source, WorkerLayout
from enginectl.contract.engine_config import frame_key
from enginectl.server.fpm.relay_zmq import FpmRelayHost
from enginectl.server.fpm.samples import SampleFilter
from enginectl.server.weights.sources.channels import ChannelSettings, DroppedFrames, UpdateChannels
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.ranks import place

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # any one wait: far above what it takes (well under a second)
BOUND_S = 2.0  # the liveness bound node B's publisher is given here (10 s by default)

# Node B: a stranger (XPUB, so it knows when the relay subscribed) sends 3 unkeyed samples and
# then one keyed sample on the same socket; then rank 1's real publisher runs, configured as
# CONFIGURE configures a remote rank, until it reports its head lost (or WAIT_S passes).
PUBLISHER = """
import json, sys, threading, zmq
from enginectl.contract.engine_config import EngineConfig
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.worker.fpm.identity import WorkerIdentity
from enginectl.worker.fpm.publisher import FpmPublisher, PublisherConfig

tcp, ipc, secret, incarnation, bound, wait = sys.argv[1:7]
config = EngineConfig(
    fpm_endpoint=ipc, fpm_tcp_endpoint=tcp, head_hostname="the-head", head_boot_id="its-boot",
    channel_secret=secret, incarnation=incarnation, worker_id="node-b-w",
    heartbeat_interval_s=0.05, liveness_timeout_s=float(bound), headless=True,
)
publisher_config = PublisherConfig.from_engine_config(config)

context = zmq.Context()
stranger = context.socket(zmq.XPUB)
stranger.connect(publisher_config.endpoint)
assert stranger.poll(int(float(wait) * 1000)), "the relay never subscribed"
stranger.recv()
def sample(worker):
    return fpm_pb2.ForwardPassMetrics(schema_version=1, worker_id=worker, dp_rank=1, counter_id=1,
                                      incarnation="stranger", kind=fpm_pb2.SAMPLE_KIND_STEP).SerializeToString()
for _ in range(3):
    stranger.send(sample("stranger"))
stranger.send(publisher_config.key + sample("keyed-after"))
stranger.close(linger=5000)

lost = threading.Event()
why = []
publisher = FpmPublisher(
    publisher_config, dp_rank=1, identity=WorkerIdentity("node-b-w"), activity=lambda: (0, 0, 0),
    head_lost=lambda message: (why.append(message), lost.set()),
).start()
print(json.dumps({"endpoint": publisher_config.endpoint}), flush=True)
print(json.dumps({"lost": why[0] if lost.wait(float(wait)) else None}), flush=True)
"""


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    with two_nodes() as made:
        yield made


async def test_a_remote_ranks_publisher_reaches_the_relay_keyed_and_notices_it_gone(nodes: TwoNodes) -> None:
    secret, incarnation = secrets.token_hex(16), secrets.token_hex(8)
    key = frame_key(incarnation, secret)
    host = FpmRelayHost(key=key, tcp_address=nodes.head_address)
    relay = host.start(WeightVersionLedger())
    subscription = relay.subscribe(SampleFilter(include_heartbeats=True))
    assert host.tcp_endpoint.startswith(f"tcp://{nodes.head_address}:")
    proc = nodes.python(PUBLISHER, host.tcp_endpoint, host.endpoint, secret, incarnation, str(BOUND_S), str(WAIT_S))
    stopped = False
    try:
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT_S))
        assert first["endpoint"] == host.tcp_endpoint  # another host than the head's: TCP
        seen: set[tuple[str, int]] = set()
        while not {("keyed-after", 1), ("node-b-w", 1)} <= seen:
            assert await subscription.wait(WAIT_S), f"no sample within {WAIT_S}s; seen {seen}"
            batch, _ = subscription.take(1000)
            seen |= {relayed.key for relayed in batch}
        assert ("stranger", 1) not in seen
        assert relay.stats.dropped_unkeyed == 3  # the keyed sample came after them, on their socket
        assert relay.last_seen[1] > 0
        await host.stop()  # the head is gone
        stopped = True
        last = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT_S + BOUND_S))
        assert last["lost"] is not None and host.tcp_endpoint in last["lost"], last
    finally:
        subscription.close()
        if not stopped:
            await host.stop()
        proc.kill()
        proc.communicate()


# Node B: rank 1's worker end of an update (argv: the plan as JSON): every chunk until the abort,
# then its progress, sent over the plan's TCP progress endpoint.
WORKER = """
import json, sys
from types import SimpleNamespace
import msgspec
from enginectl.contract.engine import LoadPlan
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.ranks import place

plan = msgspec.json.decode(sys.argv[1], type=LoadPlan)
parallel = SimpleNamespace(data_parallel_index=1, data_parallel_rank=1, world_size=1)
channel = Channel(plan, place(SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), rank=0)))
got, nbytes = [], 0
try:
    while True:
        chunk = channel.recv()
        got.append(chunk.offset)
        nbytes += len(chunk.data)
except Abort as stop:
    cause = stop.cause.value
channel.progress(len(got), nbytes, force=True)
channel.close(linger_ms=5000)
print(json.dumps({"offsets": got, "cause": cause}), flush=True)
"""


def _local_worker(plan: LoadPlan) -> list[int]:
    parallel = SimpleNamespace(data_parallel_index=0, data_parallel_rank=0, world_size=1)
    channel = Channel(plan, place(SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), rank=0)))
    got: list[int] = []
    try:
        while True:
            got.append(channel.recv().offset)
    except Abort:
        return got
    finally:
        channel.close()


async def test_an_updates_channels_reach_a_worker_on_node_b_over_tcp(nodes: TwoNodes, tmp_path: Path) -> None:
    context = zmq.asyncio.Context()
    key = frame_key(secrets.token_hex(8), secrets.token_hex(16))
    settings = ChannelSettings(key=key, remote_ranks=frozenset({1}), tcp_address=nodes.head_address)
    channels = UpdateChannels(context, tmp_path, "op", WorkerLayout(2, 1), settings, DroppedFrames())
    try:
        assert [e.split("://")[0] for e in channels.data_endpoints] == ["ipc", "tcp"]
        plan = LoadPlan(
            source=Source.TENSORS,
            files=(),
            tensors=(),
            group="",
            data_endpoints=channels.data_endpoints,
            progress_endpoint=channels.progress_endpoint,
            timeout_s=WAIT_S,
            key=channels.key,
            progress_tcp_endpoint=channels.progress_tcp_endpoint,
        )
        remote = nodes.python(WORKER, msgspec.json.encode(plan).decode())
        local = asyncio.ensure_future(asyncio.to_thread(_local_worker, plan))
        for offset in range(8):
            await asyncio.wait_for(channels.send_chunk(offset, bytes([offset]) * 1000), WAIT_S)
        channels.abort(Cause.UPDATE_CANCELLED, "done")
        assert await asyncio.wait_for(local, WAIT_S) == list(range(8))
        out, err = await asyncio.to_thread(remote.communicate, timeout=WAIT_S)
        assert json.loads(out) == {"offsets": list(range(8)), "cause": Cause.UPDATE_CANCELLED.value}, err
        assert await asyncio.wait_for(channels.next_progress(), WAIT_S) == (1, 0, 8, 8000)
    except subprocess.TimeoutExpired:
        pytest.fail("node B's worker did not finish")
    finally:
        channels.close()
        context.destroy(0)
