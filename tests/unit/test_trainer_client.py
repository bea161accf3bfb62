"""The trainer client's pure parts, without a server: bucket packing round-trips mixed dtypes
byte for byte, and the plain progress bar. The trainer client on a real engine is in
tests/e2e/test_trainer_client.py.
"""

from __future__ import annotations


def test_buckets_pack_and_unpack_mixed_dtypes_byte_for_byte() -> None:
    """The trainer's packing (BroadcastGroup) and a worker's unpacking (typed_view) of the
    same cut round-trip tensors of mixed dtypes and odd sizes (a 1-byte tensor of odd length
    leaves the next one unaligned), without a process group."""
    import torch

    from enginectl.client.trainer_tensors import BroadcastGroup
    from enginectl.common.buckets import cut
    from enginectl.worker.weights.groups import typed_view

    tensors = [
        torch.arange(5, dtype=torch.uint8),
        torch.randn(3, 7),
        torch.tensor([True, False, True]),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.arange(6, dtype=torch.int64).reshape(3, 2),
        torch.randn(40, 40),
    ]
    sizes = [t.numel() * t.element_size() for t in tensors]
    plan = cut(sizes, 100)
    assert [(b.start, b.stop) for b in plan] == [(0, 3), (3, 5), (5, 6)]
    group = BroadcastGroup("pack", "gloo", None, 2, 1.0)
    for bucket in plan:
        if not bucket.packed:
            continue
        flat = group._pack(tensors[bucket.start : bucket.stop], bucket.nbytes)
        for i, offset in zip(range(bucket.start, bucket.stop), bucket.offsets, strict=True):
            dtype = str(tensors[i].dtype).removeprefix("torch.")
            back = typed_view(flat.clone(), offset, dtype, tuple(tensors[i].shape))
            assert back.dtype == tensors[i].dtype and torch.equal(back, tensors[i]), i
    assert [(b.start, b.stop) for b in cut(sizes, 0)] == [(i, i + 1) for i in range(len(tensors))]


def test_plain_progress_bar_draws_bytes_and_phase() -> None:
    """Without tqdm the bar is plain text on the given stream (pure logic: no server)."""
    import io

    from enginectl.client import ProgressBar, UpdateProgress

    def progress(done: int, phase: str) -> UpdateProgress:
        return UpdateProgress(
            phase=phase,
            source="DISK",
            weight_version="v",
            tensors_done=done // 100,
            tensors_total=4,
            bytes_done=done,
            bytes_total=400,
            weights_modified=done > 0,
            paused_by_update=True,
            ranks=(),
        )

    out = io.StringIO()
    bar = ProgressBar(out, use_tqdm=False)
    bar.update(progress(200, "LOADING"))
    bar.update(progress(200, "LOADING"))  # unchanged: not drawn again
    bar.update(progress(400, "DONE"))
    bar.close()
    lines = out.getvalue().split("\r")[1:]
    assert len(lines) == 2
    assert "50.0%" in lines[0] and "2/4 tensors" in lines[0] and "LOADING" in lines[0]
    assert "100.0%" in lines[1] and "DONE" in lines[1] and lines[1].endswith("\n")


async def test_a_loopback_master_is_refused_when_a_rank_runs_on_another_host() -> None:
    """Before a trainer hosts a group, it compares every rank's host (GetServerInfo's
    RankInfo.host_id, from the servers' census) with its own: a loopback master_address with a
    rank elsewhere is FAILED_PRECONDITION MASTER_ADDRESS_LOOPBACK, naming the rank; a routable
    address, or every rank on this host, passes (docs/multinode.md)."""
    import pytest

    from enginectl.client.errors import FailedPreconditionError
    from enginectl.client.master_address import refuse_loopback_master
    from enginectl.client.trainer_types import ServerInfo
    from enginectl.common.host import HostIdentity, host_identity
    from enginectl.weights.v1 import weight_update_service_pb2 as pb2

    here, there = host_identity(), HostIdentity("another-boot", "node-b")

    def server(*hosts: HostIdentity) -> ServerInfo:
        ranks = [pb2.RankInfo(dp_rank=r, host=h.hostname, host_id=h.host_id) for r, h in enumerate(hosts)]
        return ServerInfo.from_proto(pb2.GetServerInfoResponse(ranks=ranks))

    with pytest.raises(FailedPreconditionError) as refused:
        await refuse_loopback_master("127.0.0.1", {"a:1": server(here), "b:2": server(here, there)})
    assert refused.value.reason == "MASTER_ADDRESS_LOOPBACK"
    assert "b:2: rank 1 on node-b" in refused.value.message and "a:1" not in refused.value.message
    with pytest.raises(FailedPreconditionError):
        await refuse_loopback_master("localhost", {"": server(there)})
    await refuse_loopback_master("10.0.0.7", {"": server(here, there)})  # routable: every node dials it
    await refuse_loopback_master("127.0.0.1", {"": server(here, here)})  # every rank here
    older = ServerInfo.from_proto(pb2.GetServerInfoResponse(ranks=[pb2.RankInfo(dp_rank=0, host="node-b")]))
    await refuse_loopback_master("127.0.0.1", {"": older})  # a server without host ids: its own check stands
