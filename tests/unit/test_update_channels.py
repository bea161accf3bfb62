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

import pytest
import zmq.asyncio

from enginectl.contract.engine import Cause, LoadPlan, Source, WorkerLayout
from enginectl.server.weights.sources.channels import UpdateChannels
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
        deadline=time.time() + 30,
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
