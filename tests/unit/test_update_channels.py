"""An update's ZMQ channels with more than one worker per DP rank (tensor parallelism), on real
ZMQ sockets: the server's end (server/weights/sources/channels.py) and every worker's end
(worker/weights/channel.py) in this process, no vLLM.

A PUSH deals its messages round-robin between connected peers, so channels shared by the
workers of a rank would give each part of the stream (docs/architecture.md, "Update
channels"); these tests fail if two workers ever share a data channel. The same layout runs on
a real TP=2 engine in tests/e2e/test_tensor_parallel.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from enginectl.contract import frames
from enginectl.contract.engine import Cause, LoadPlan, Source, WorkerLayout
from enginectl.contract.engine_config import frame_key
from enginectl.server.weights.sources.channels import ChannelSettings, DroppedFrames, UpdateChannels
from enginectl.server.weights.update.operations import ProgressTally, UpdateOperation
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.ranks import place

DP, TP = 2, 2
CHUNKS = 12  # more than the workers of a rank, so round-robin dealing would show


def _worker(dp_rank: int, tp_rank: int) -> SimpleNamespace:
    """What ranks.py reads of a vLLM worker: its DP rank and world size, and its rank."""
    parallel = SimpleNamespace(data_parallel_index=dp_rank, data_parallel_rank=dp_rank, world_size=TP)
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), rank=tp_rank)


def _plan(channels: UpdateChannels) -> LoadPlan:
    return LoadPlan(
        source=Source.TENSORS,
        files=(),
        tensors=(),
        group="",
        data_endpoints=channels.data_endpoints,
        progress_endpoint=channels.progress_endpoint,
        timeout_s=30.0,
    )


@pytest.fixture
async def channels(tmp_path: Path) -> UpdateChannels:
    ctx = zmq.asyncio.Context()
    chans = UpdateChannels(ctx, tmp_path, "op", WorkerLayout(DP, TP))
    yield chans
    chans.close()
    ctx.destroy(0)


def test_every_worker_of_every_rank_has_its_own_data_channel(channels: UpdateChannels) -> None:
    layout = WorkerLayout(DP, TP)
    assert len(channels.data_endpoints) == layout.workers == DP * TP
    assert len(set(channels.data_endpoints)) == DP * TP  # none twice
    # Each worker finds its channel where the server put it: its index on the worker side
    # (ranks.py, from vLLM's config) is the layout's.
    indices = [place(_worker(r, w)).index for r in range(DP) for w in range(TP)]
    assert indices == [layout.index(r, w) for r in range(DP) for w in range(TP)] == list(range(DP * TP))
    with pytest.raises(ValueError):
        layout.index(0, TP)


async def test_every_worker_receives_every_chunk_and_every_abort(channels: UpdateChannels) -> None:
    plan = _plan(channels)
    workers = [Channel(plan, place(_worker(r, w))) for r in range(DP) for w in range(TP)]
    try:
        for offset in range(CHUNKS):
            await channels.send_chunk(offset, bytes([offset]) * 4)

        def drain(channel: Channel) -> list[int] | str:
            got: list[int] = []
            try:
                while True:
                    got.append(channel.recv().offset)
            except Abort as exc:
                return got if exc.cause == Cause.UPDATE_CANCELLED else str(exc)

        channels.abort(Cause.UPDATE_CANCELLED, "CancelOperation")
        received = await asyncio.gather(*(asyncio.to_thread(drain, w) for w in workers))
        assert received == [list(range(CHUNKS))] * (DP * TP)
    finally:
        for w in workers:
            w.close()


async def test_progress_names_the_worker(channels: UpdateChannels) -> None:
    plan = _plan(channels)
    worker = Channel(plan, place(_worker(1, 1)))
    try:
        worker.progress(3, 300, force=True)
        assert await asyncio.wait_for(channels.next_progress(), 10) == (1, 1, 3, 300)
    finally:
        worker.close()


def test_a_rank_has_loaded_what_every_worker_of_it_has() -> None:
    layout = WorkerLayout(DP, TP)
    op = UpdateOperation(
        "operations/x",
        pb2.UpdateWeightsMetadata(ranks=[pb2.RankUpdateProgress(dp_rank=r) for r in range(DP)]),
    )
    tally = ProgressTally(layout)
    op.record_progress(tally, 0, 0, 5, 500)
    rank0 = op.metadata.ranks[0]
    # One worker of rank 0 wrote: the weights may be mixed already, but the rank has not
    # loaded anything every worker of it has.
    assert op.metadata.weights_modified
    assert (rank0.tensors_done, [(w.worker_rank, w.tensors_loaded) for w in rank0.workers]) == (0, [(0, 5)])
    op.record_progress(tally, 0, 1, 2, 200)
    assert (rank0.tensors_done, rank0.bytes_done) == (2, 200)
    assert [(w.worker_rank, w.tensors_loaded, w.weights_modified) for w in rank0.workers] == [
        (0, 5, True),
        (1, 2, True),
    ]
    assert op.metadata.tensors_done == 0  # rank 1 has not reported
    op.record_progress(tally, 1, 1, 7, 700)
    op.record_progress(tally, 1, 0, 4, 400)
    assert (op.metadata.tensors_done, op.metadata.bytes_done) == (2, 200)


# --- ranks on other hosts (DESIGN §13): TCP for their workers, a key on every message --------

KEY = frame_key("0123456789abcdef", "00" * 16)


@pytest.fixture
async def spanning(tmp_path: Path) -> UpdateChannels:
    """Channels of an engine whose rank 1 runs on another host: its workers' sockets listen on
    TCP (at loopback here: these tests cross no host, tests/e2e/multinode does)."""
    ctx = zmq.asyncio.Context()
    settings = ChannelSettings(key=KEY, remote_ranks=frozenset({1}), tcp_address="127.0.0.1")
    chans = UpdateChannels(ctx, tmp_path, "op", WorkerLayout(DP, TP), settings, DroppedFrames())
    yield chans
    chans.close()
    ctx.destroy(0)


def _keyed_plan(channels: UpdateChannels, timeout_s: float = 30.0) -> LoadPlan:
    return msgspec.structs.replace(
        _plan(channels), key=channels.key, progress_tcp_endpoint=channels.progress_tcp_endpoint, timeout_s=timeout_s
    )


def test_a_remote_ranks_workers_are_reached_over_tcp(spanning: UpdateChannels) -> None:
    schemes = [endpoint.split("://")[0] for endpoint in spanning.data_endpoints]
    assert schemes == ["ipc", "ipc", "tcp", "tcp"]  # rank 0's two workers, then rank 1's
    assert spanning.progress_tcp_endpoint.startswith("tcp://127.0.0.1:")
    assert spanning.progress_endpoint.startswith("ipc://")


async def test_keyed_chunks_and_progress_reach_every_worker_local_and_remote(spanning: UpdateChannels) -> None:
    plan = _keyed_plan(spanning)
    workers = [Channel(plan, place(_worker(r, w))) for r in range(DP) for w in range(TP)]
    try:
        for offset in range(CHUNKS):
            await spanning.send_chunk(offset, bytes([offset]) * 4)
        got = await asyncio.gather(
            *(asyncio.to_thread(lambda c=c: [c.recv().offset for _ in range(CHUNKS)]) for c in workers)
        )
        assert got == [list(range(CHUNKS))] * (DP * TP)
        workers[3].progress(2, 20, force=True)  # rank 1, worker 1: over TCP
        workers[0].progress(1, 10, force=True)  # rank 0, worker 0: over ipc
        reports = {await asyncio.wait_for(spanning.next_progress(), 10) for _ in range(2)}
        assert reports == {(1, 1, 2, 20), (0, 0, 1, 10)}
    finally:
        for w in workers:
            w.close()


async def test_a_strangers_progress_frame_is_dropped_and_counted(spanning: UpdateChannels) -> None:
    """Someone who can reach the TCP endpoint but has not this start's key: its frame is never
    read as progress; the next keyed one is."""
    dropped = spanning._dropped
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(spanning.progress_tcp_endpoint)
    worker = Channel(_keyed_plan(spanning), place(_worker(1, 0)))
    try:
        stranger.send(frames.progress(1, 0, 99, 9999))  # no key
        stranger.send(frames.progress(1, 0, 98, 9998, key=frame_key("0123456789abcdef", "11" * 16)))  # another secret
        assert await asyncio.wait_for(spanning.next_report(), 10) is None
        assert await asyncio.wait_for(spanning.next_report(), 10) is None
        worker.progress(3, 30, force=True)
        assert await asyncio.wait_for(spanning.next_progress(), 10) == (1, 0, 3, 30)
        assert dropped.unkeyed == 2
    finally:
        worker.close()
        stranger.close(0)


async def test_a_worker_drops_a_data_message_without_the_key(spanning: UpdateChannels) -> None:
    worker = Channel(_keyed_plan(spanning), place(_worker(0, 0)))
    try:
        await spanning.data[0].send_multipart(frames.chunk(7, b"evil"))  # unkeyed: dropped
        await spanning.data[0].send_multipart(frames.abort(Cause.UPDATE_CANCELLED, "forged"))  # unkeyed: dropped
        await spanning.data[0].send_multipart(frames.chunk(1, b"good", key=spanning.key))  # only this worker listens
        chunk = await asyncio.to_thread(worker.recv)
        assert (chunk.offset, bytes(chunk.data), worker.unkeyed) == (1, b"good", 2)
    finally:
        worker.close()


async def test_a_worker_counts_the_time_left_on_its_own_clock(spanning: UpdateChannels) -> None:
    """The plan carries the time left, not the server's wall clock: a worker whose clock is
    hours off still stops when the update's time is up, and not before."""
    worker = Channel(_keyed_plan(spanning, timeout_s=0.2), place(_worker(1, 0)))
    try:
        began = time.monotonic()
        with pytest.raises(Abort) as stopped:
            await asyncio.to_thread(worker.recv)
        assert stopped.value.cause == Cause.UPDATE_TIMEOUT
        assert time.monotonic() - began >= 0.2
    finally:
        worker.close()


async def test_a_server_of_ranks_2_and_3_opens_channels_for_their_workers_only(tmp_path: Path) -> None:
    """Under hybrid load balancing a node's server manages ranks 2..3 of 4 (docs/multinode.md,
    "One server per node"): one channel per worker of those ranks, and each worker, knowing
    only its engine-wide rank, finds its own through the plan's first_worker. With channels
    for all four ranks a send would wait on workers this server never reaches."""
    ctx = zmq.asyncio.Context()
    layout = WorkerLayout(DP, TP, first_rank=2)
    chans = UpdateChannels(ctx, tmp_path, "op", layout)
    plan = msgspec.structs.replace(_plan(chans), first_worker=layout.first_worker)
    workers = [Channel(plan, place(_worker(r, w))) for r in layout.dp_ranks for w in range(TP)]
    try:
        assert len(chans.data_endpoints) == DP * TP and layout.first_worker == 2 * TP
        assert [c.slot for c in workers] == list(range(DP * TP))
        for offset in range(CHUNKS):
            await asyncio.wait_for(chans.send_chunk(offset, bytes([offset])), 10)
        got = await asyncio.gather(
            *(asyncio.to_thread(lambda c=c: [c.recv().offset for _ in range(CHUNKS)]) for c in workers)
        )
        assert got == [list(range(CHUNKS))] * (DP * TP)
        tally = ProgressTally(layout)
        for c in workers:
            c.progress(5, 50, force=True)
        for _ in workers:
            dp_rank, worker, tensors, done = await asyncio.wait_for(chans.next_progress(), 10)
            tally.latest[(dp_rank, worker)] = (tensors, done)
        assert sorted({r for r, _ in tally.latest}) == [2, 3] and tally.total() == (5, 50)
    finally:
        for c in workers:
            c.close()
        chans.close()
        ctx.destroy(0)


def test_a_layout_from_rank_2_numbers_its_workers_from_0_and_refuses_other_ranks() -> None:
    layout = WorkerLayout(2, 2, first_rank=2)
    assert list(layout.dp_ranks) == [2, 3]
    assert [layout.index(r, w) for r in (2, 3) for w in (0, 1)] == [0, 1, 2, 3]
    for rank in (0, 1, 4):
        with pytest.raises(ValueError, match="ranks 2..3"):
            layout.index(rank, 0)
