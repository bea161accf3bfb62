"""Same-host updates by reference (UpdateWeightsFromIpc), without a server: which targets are
this host, the worker's own mapping checked against the torch in use, the server's handle
checks at their edges, and that the RPC needs the token. IPC updates on a real engine are in
tests/e2e/weight_updates/test_weights_ipc.py.
"""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginectl.client import Reason
from enginectl.client.trainer_ipc import is_local_target
from enginectl.contract.engine import IpcHandle, LoadPlan, Source, TensorSpec
from enginectl.weights.v1 import weight_update_service_pb2 as upb


@pytest.mark.parametrize(
    ("target", "local"),
    [
        ("127.0.0.1:50051", True),
        ("127.3.2.1:1", True),
        ("localhost:50051", True),
        ("localhost", True),
        ("[::1]:50051", True),
        ("::1", True),
        ("ipv4:127.0.0.1:50051", True),
        ("ipv6:[::1]:50051", True),
        ("dns:///localhost:50051", True),
        ("unix:/tmp/enginectl.sock", True),
        ("10.0.0.7:50051", False),
        ("engine.example:50051", False),
        ("dns:///engine.example:50051", False),
        ("ipv4:127.0.0.1:1,10.0.0.7:1", False),
        ("[2001:db8::1]:50051", False),
    ],
)
def test_which_targets_are_this_host(target: str, local: bool) -> None:
    assert is_local_target(target) is local


def _segment_size(name: str) -> int:
    return os.stat(f"/dev/shm{name}").st_size


def test_worker_maps_torch_segments_copy_on_write() -> None:
    """worker/weights/ipc.py against the torch in use: the segment layout it assumes, strided
    views, one mapping per storage, writes that never reach the trainer, nothing left mapped."""
    import torch

    from enginectl.worker.weights.ipc import SHM_HEADER_BYTES, IpcTensors

    flat = torch.arange(24, dtype=torch.float32)
    _, name, nbytes = flat.untyped_storage()._share_filename_cpu_()
    segment = name.decode()
    assert _segment_size(segment) == nbytes + SHM_HEADER_BYTES  # torch's refcount header
    views = {"t": flat[2:].as_strided((6, 3), (1, 6)), "u": flat.view(4, 6)}
    plan = LoadPlan(
        source=Source.IPC,
        files=(),
        tensors=tuple(TensorSpec(n, "float32", tuple(v.shape)) for n, v in views.items()),
        group="",
        data_endpoints=(),
        progress_endpoint="",
        timeout_s=0.0,
        handles=tuple(IpcHandle(v.storage_offset(), tuple(v.stride()), segment, nbytes) for v in views.values()),
    )
    trainer_only = _mappings_here(segment)  # the tensor's own storage maps it once
    mapped = IpcTensors(plan, 0)
    try:
        rebuilt = dict(mapped.pairs)
        assert all(rebuilt[n].equal(v) for n, v in views.items())
        assert rebuilt["t"].untyped_storage().data_ptr() == rebuilt["u"].untyped_storage().data_ptr()
        assert rebuilt["u"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert _mappings_here(segment) == trainer_only + 1  # one more, for both tensors
        rebuilt["u"].fill_(-1.0)
        assert flat.equal(torch.arange(24, dtype=torch.float32))
        del rebuilt
    finally:
        mapped.close()
    assert _mappings_here(segment) == trainer_only


def _mappings_here(segment: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"/dev/shm{segment}" in line)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    shape=st.lists(st.integers(0, 2**40), max_size=3),
    stride=st.lists(st.sampled_from([-(2**63), -1, 0, 1, 7, 2**31, 2**63 - 1]), max_size=4),
    offset=st.sampled_from([0, 1, 2**32, 2**64 - 1]),
    nbytes=st.sampled_from([0, 1, 64, 2**40, 2**64 - 1]),
    segment=st.sampled_from(["/torch_1_2_3", "/torch_1_2_3/..", "torch_1_2_3", "", "/psm_1", "/torch_1_2_3\x00"]),
    shares=st.integers(0, 2),
    kind=st.sampled_from(["shared_memory", "cuda", ""]),
)
def test_handle_checks_answer_every_input_with_a_reason(
    shape: list[int], stride: list[int], offset: int, nbytes: int, segment: str, shares: int, kind: str
) -> None:
    """Any handle is either accepted, and then keeps the tensor inside its storage, or refused
    with IPC_HANDLE_INVALID; never another error."""
    from enginectl.server.errors import ControlPlaneError
    from enginectl.server.weights.sources.disk import TensorInfo
    from enginectl.server.weights.sources.ipc import ipc_handles

    handle = upb.IpcTensorHandle(storage_offset=offset, stride=stride)
    if kind == "shared_memory":
        handle.shared_memory.segment_name = segment
        handle.shared_memory.storage_nbytes = nbytes
    elif kind == "cuda":
        for _ in range(shares):
            handle.cuda.shares.append(
                upb.CudaIpcShare(memory_handle=b"m" * 64, storage_nbytes=nbytes, ref_counter_handle=segment.encode())
            )
    tensor = TensorInfo("w", "bfloat16", tuple(shape))
    try:
        (accepted,) = ipc_handles([tensor], [handle], num_workers=1)
    except ControlPlaneError as refused:
        assert refused.reason == Reason.IPC_HANDLE_INVALID, refused
        return
    size = accepted.storage_nbytes if kind == "shared_memory" else accepted.cuda[0].storage_nbytes
    if 0 not in shape:
        last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
        assert (last + 1) * 2 <= size


async def test_ipc_updates_need_the_token() -> None:
    from enginectl.server.grpc_server import ControlPlaneServer
    from enginectl.server.weights.version.ledger import WeightVersionLedger
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc

    plane = ControlPlaneServer(WeightVersionLedger(), token="s3cret-token")
    port = await plane.start("127.0.0.1", 0)
    await plane.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = upb_grpc.WeightUpdateServiceStub(channel).UpdateWeightsFromIpc
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await call(upb.UpdateWeightsFromIpcRequest(), timeout=30)
            assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # With the token the call reaches the servicer (this server has no engine).
            with pytest.raises(grpc.aio.AioRpcError) as past_auth:
                await call(
                    upb.UpdateWeightsFromIpcRequest(), timeout=30, metadata=[("authorization", "Bearer s3cret-token")]
                )
            assert past_auth.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await plane.stop(0)
