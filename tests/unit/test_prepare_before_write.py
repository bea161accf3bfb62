"""Prepare before write (DESIGN §13): what a worker checks of a disk update's files before
anything is written, how the server turns a worker that can not read them into a clean
refusal, and the refusals of an IPC update and a loopback group master when a rank runs on
another host. Real safetensors files and FIFOs, the real worker check and the real server
checks; WeightUpdates runs against tests/support/engine_double.py, whose `prepare` is the real
worker check. The normal disk update with its prepare on a real engine is in
tests/e2e/weight_updates/test_weight_update.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support.engine_double import EngineDouble

from enginectl.common.vocabulary import Reason
from enginectl.contract.prepare import PlannedFile, PreparePlan, PrepareProblem
from enginectl.server.errors import ControlPlaneError
from enginectl.server.weights.sources.disk import read_planned
from enginectl.server.weights.sources.groups import check_master_reachable, is_loopback
from enginectl.server.weights.sources.ipc import check_ranks_local
from enginectl.server.weights.sources.prepare import refusal
from enginectl.server.weights.update.operations import OperationStore
from enginectl.server.weights.update.plans import TensorInfo
from enginectl.server.weights.updates import WeightUpdates
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.worker.weights.prepare import prepare

REMOTE = {1: "node-b"}  # the census's remote ranks: rank 1 runs on node-b
# name -> (safetensors dtype, shape), laid out in this order, unpadded.
LAYOUT = {"embed.weight": ("F32", [4, 2]), "norm.weight": ("F32", [2]), "head.bias": ("BF16", [3])}
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


def write_safetensors(path: Path, layout: dict[str, tuple[str, list[int]]], data_bytes: int | None = None) -> Path:
    """A safetensors file of `layout` (zero bytes of data; `data_bytes` cuts the data short)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in layout.items():
        size = ITEMSIZE[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    data = bytes(offset if data_bytes is None else data_bytes)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    return path


@pytest.fixture
def planned(tmp_path: Path) -> PlannedFile:
    """The header the head planned from: model.safetensors of LAYOUT."""
    return read_planned(write_safetensors(tmp_path / "model.safetensors", LAYOUT))


def check(path: Path, planned: PlannedFile, dp_rank: int = 1) -> tuple[PrepareProblem | None, str]:
    """What worker 0 of `dp_rank` answers when the planned file is at `path` on its host."""
    answer = prepare(PreparePlan((PlannedFile(str(path), planned.tensors),)), dp_rank, 0)
    assert (answer.dp_rank, answer.worker_rank, answer.hostname) == (dp_rank, 0, socket.gethostname())
    return answer.problem, answer.message


# --- the worker's check --------------------------------------------------------------------


def test_a_worker_reads_the_planned_file_as_planned(planned: PlannedFile) -> None:
    assert check(Path(planned.path), planned) == (None, "")


def test_a_file_missing_on_the_workers_host(tmp_path: Path, planned: PlannedFile) -> None:
    problem, message = check(tmp_path / "elsewhere" / "model.safetensors", planned)
    assert problem is PrepareProblem.MISSING
    assert "does not exist here" in message


def test_a_fifo_is_refused_without_blocking(tmp_path: Path, planned: PlannedFile) -> None:
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    problem, message = check(fifo, planned)
    assert problem is PrepareProblem.NOT_REGULAR
    assert "a fifo" in message
    problem, _ = check(tmp_path, planned)  # a directory
    assert problem is PrepareProblem.NOT_REGULAR


@pytest.mark.parametrize(
    ("layout", "difference"),
    [
        ({**LAYOUT, "norm.weight": ("F16", [2])}, "tensor 'norm.weight' is float16 here, float32 as planned"),
        ({**LAYOUT, "norm.weight": ("F32", [1, 2])}, "tensor 'norm.weight' has shape [1, 2] here, [2] as planned"),
        (  # the same tensors in another order: offsets differ
            {
                "norm.weight": LAYOUT["norm.weight"],
                "embed.weight": LAYOUT["embed.weight"],
                "head.bias": LAYOUT["head.bias"],
            },
            "tensor 'embed.weight' lies at data bytes [8, 40) here, [0, 32) as planned",
        ),
        ({k: v for k, v in LAYOUT.items() if k != "head.bias"}, "tensor 'head.bias' is planned but not in the header"),
        ({**LAYOUT, "extra.weight": ("F32", [1])}, "tensor 'extra.weight' is in the header here but was not planned"),
    ],
    ids=["dtype", "shape", "offset", "missing-tensor", "extra-tensor"],
)
def test_a_header_that_differs_from_the_planned_one_names_the_tensor_and_how(
    tmp_path: Path, planned: PlannedFile, layout: dict[str, tuple[str, list[int]]], difference: str
) -> None:
    other = write_safetensors(tmp_path / "other.safetensors", layout)
    problem, message = check(other, planned)
    assert problem is PrepareProblem.HEADER_DIFFERS
    assert difference in message


def test_a_truncated_header_or_data(tmp_path: Path, planned: PlannedFile) -> None:
    whole = Path(planned.path).read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[:40])  # inside the JSON header
    problem, message = check(cut, planned)
    assert problem is PrepareProblem.NOT_SAFETENSORS
    assert "truncated" in message
    cut.write_bytes(whole[:5])  # not even the header's length
    assert check(cut, planned)[0] is PrepareProblem.NOT_SAFETENSORS
    short = write_safetensors(tmp_path / "short.safetensors", LAYOUT, data_bytes=41)  # 46 planned
    problem, message = check(short, planned)
    assert problem is PrepareProblem.TRUNCATED
    assert "'head.bias' ends at byte 46" in message


NOBODY = 65534  # an unprivileged uid and gid


def check_unprivileged(path: Path, planned: PlannedFile) -> str:
    """The problem's name a worker answers for `path` when it runs as an unprivileged user.
    Root reads a file of mode 0 all the same, so under root (CI here) the check runs in a
    forked child that dropped to NOBODY first: a real permission refusal by the kernel."""
    if os.geteuid() != 0:
        problem = check(path, planned)[0]
        return problem.name if problem else "none"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the check, then _exit (no pytest, no atexit)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            problem = check(path, planned)[0]
            os.write(write, (problem.name if problem else "none").encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write, f"child failed: {exc!r}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read().decode()
    os.waitpid(pid, 0)
    return said


def test_an_unreadable_file(planned: PlannedFile) -> None:
    folder = Path(tempfile.mkdtemp())  # under /tmp, which every user may cross (tmp_path's parents may not)
    try:
        folder.chmod(0o755)
        locked = write_safetensors(folder / "locked.safetensors", LAYOUT)
        locked.chmod(0)
        assert check_unprivileged(locked, planned) == PrepareProblem.UNREADABLE.name
    finally:
        shutil.rmtree(folder)


# --- the server's refusal ------------------------------------------------------------------


def test_the_refusal_names_the_rank_its_census_host_and_why(tmp_path: Path, planned: PlannedFile) -> None:
    """Rank 0 (this host) reads the checkpoint; rank 1 (node-b in the census) has no such
    file: FAILED_PRECONDITION CHECKPOINT_NOT_ON_RANK naming rank 1, node-b and the file."""
    missing = tmp_path / "not-on-b" / "model.safetensors"
    answers = [
        prepare(PreparePlan((planned,)), 0, 0),
        prepare(PreparePlan((PlannedFile(str(missing), planned.tensors),)), 1, 0),
    ]
    error = refusal(answers, REMOTE)
    assert error is not None
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.CHECKPOINT_NOT_ON_RANK)
    assert error.metadata == {
        "dp_rank": "1",
        "worker_rank": "0",
        "host": "node-b",
        "path": str(missing),
        "problem": "missing",
        "ranks": "1",
    }
    assert f"rank 1 worker 0 (host node-b): {missing} does not exist here" in error.message
    assert "nothing was loaded" in error.message
    assert refusal(answers[:1], REMOTE) is None
    # A rank the census does not list as remote is named by the host its worker reported.
    local = refusal([answers[1]], {})
    assert local is not None and local.metadata["host"] == socket.gethostname()


@pytest.fixture
async def engine() -> EngineDouble:
    return EngineDouble()


@pytest.fixture
async def updates(engine: EngineDouble, tmp_path: Path, planned: PlannedFile) -> AsyncIterator[WeightUpdates]:
    ledger = WeightVersionLedger(publish=engine.set_weight_version)
    expected = {t.name: TensorInfo(t.name, t.dtype, t.shape) for t in planned.tensors}
    updates = WeightUpdates(
        engine, ledger, OperationStore(), allowed_roots=[tmp_path], expected=expected, remote_ranks=REMOTE
    )
    await updates.prepare()
    yield updates
    updates.close()


async def test_a_disk_update_is_prepared_before_it_pauses_or_loads(
    updates: WeightUpdates, engine: EngineDouble, planned: PlannedFile
) -> None:
    engine.running = 1
    op = await updates.update_from_disk(pb2.UpdateWeightsFromDiskRequest(path=planned.path, weight_version="v1"))
    await updates.operations.wait(op, 10.0)
    assert op.failure is None
    assert engine.calls[:3] == ["prepare", "pause:keep", "load"]


async def test_a_checkpoint_changed_since_planning_is_refused_with_nothing_touched(
    updates: WeightUpdates, engine: EngineDouble, tmp_path: Path, planned: PlannedFile
) -> None:
    """The head planned from one header; the worker finds another: the update is refused
    before any Operation, pause or load, and the engine is neither quarantined nor paused."""
    request = pb2.UpdateWeightsFromDiskRequest(path=planned.path, weight_version="v1")
    plan = updates.validator.disk(request)
    write_safetensors(Path(planned.path), {**LAYOUT, "norm.weight": ("F16", [2])})
    engine.running = 1
    with pytest.raises(ControlPlaneError) as err:
        await updates.start(plan)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.CHECKPOINT_NOT_ON_RANK)
    assert err.value.metadata["problem"] == "header_differs"
    assert "'norm.weight' is float16 here, float32 as planned" in err.value.message
    assert engine.calls == ["prepare"]
    assert not engine.paused and engine.weights == "A"
    assert updates.operations.list() == []  # no Operation: a refusal of the RPC itself
    assert not updates.generation.quarantined and not updates.generation.updating()
    # Nothing held: the next update (of the file as it is now) runs.
    write_safetensors(Path(planned.path), LAYOUT)
    op, started = await updates.start(updates.validator.disk(request))
    assert started
    await updates.operations.wait(op, 10.0)
    assert op.failure is None


# --- IPC and broadcast groups with a rank on another host ----------------------------------


def test_ipc_is_refused_when_a_rank_runs_on_another_host() -> None:
    check_ranks_local({})  # one host: nothing to refuse
    with pytest.raises(ControlPlaneError) as err:
        check_ranks_local({2: "node-c", 1: "node-b"})
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_SAME_HOST)
    assert err.value.metadata == {"remote_ranks": "1,2", "remote_hosts": "node-b,node-c"}
    assert "IPC handles are host-local" in err.value.message
    assert "rank 1 on node-b, rank 2 on node-c" in err.value.message


async def test_an_ipc_update_to_an_engine_with_a_remote_rank_is_refused_first(updates: WeightUpdates) -> None:
    """Even from this host's trainer, and before its other fields are read; IPC is not offered."""
    with pytest.raises(ControlPlaneError) as err:
        await updates.update_from_ipc(pb2.UpdateWeightsFromIpcRequest())
    assert err.value.reason == Reason.NOT_SAME_HOST
    assert err.value.metadata["remote_hosts"] == "node-b"
    assert pb2.UPDATE_BACKEND_IPC not in updates.backends()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_a_loopback_master_is_refused_when_a_rank_runs_on_another_host(address: str) -> None:
    assert is_loopback(address)
    check_master_reachable(address, {})  # one host: loopback is right
    with pytest.raises(ControlPlaneError) as err:
        check_master_reachable(address, REMOTE)
    assert (err.value.code, err.value.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.MASTER_ADDRESS_LOOPBACK,
    )
    assert err.value.metadata == {"master_address": address, "remote_ranks": "1", "remote_hosts": "node-b"}
    assert "rank 1 on node-b" in err.value.message and "every node can reach" in err.value.message


def test_a_name_is_loopback_when_it_resolves_to_loopback_only() -> None:
    name = socket.gethostname()
    resolved = {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    assert is_loopback(name) is all(a.startswith("127.") or a == "::1" for a in resolved)
    assert not is_loopback("10.0.0.7") and not is_loopback("2001:db8::1")
    assert not is_loopback("no-such-host.invalid")  # the join fails as it would
    check_master_reachable("10.0.0.7", REMOTE)


async def test_a_group_with_a_loopback_master_is_refused_before_any_worker_joins(
    updates: WeightUpdates, engine: EngineDouble
) -> None:
    request = pb2.InitWeightsUpdateGroupRequest(
        group_name="g",
        master_address="127.0.0.1",
        master_port=29500,
        rank_offset=1,
        world_size=2,
        backend=pb2.GROUP_BACKEND_GLOO,
    )
    with pytest.raises(ControlPlaneError) as err:
        await updates.init_group(request)
    assert err.value.reason == Reason.MASTER_ADDRESS_LOOPBACK
    assert "g" not in updates.groups
