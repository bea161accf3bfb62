"""Bounded inputs and the version ledger's answers, on real servers.

- GetServerInfo lists allowed_weight_roots only to the token's holder;
- a disk update refuses FIFOs, sockets and devices at once (NOT_A_REGULAR_FILE), never
  blocking on them;
- ETAG_MISMATCH carries the current etag; a watch resumes only within its incarnation;
- versions refuse control characters everywhere a version is accepted;
- the bounds table (server/limits.py) is what GetServerInfo reports.

One server of this module (`guarded`) has a token and allows weights from a temporary root
holding the special files (and from /dev); the session's shared `server` is the second
incarnation for the watch test and the target of the token-less checks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.longrunning import operations_pb2, operations_pb2_grpc
from support.serving import ServeProcess

from enginectl.client import (
    AbortedError,
    AsyncClient,
    Client,
    EnginectlError,
    InvalidArgumentError,
    OutOfRangeError,
    Reason,
    WeightVersion,
)
from enginectl.client.errors import from_rpc_error
from enginectl.server import limits
from enginectl.weights.v1 import weight_update_service_pb2 as upb
from enginectl.weights.v1 import weight_update_service_pb2_grpc as upb_grpc
from enginectl.weights.v1 import weight_version_service_pb2 as vpb
from enginectl.weights.v1 import weight_version_service_pb2_grpc as vpb_grpc

TOKEN = "inputs-and-ledger-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# A refusal must come at once; a disk update that blocks on a special file would hit this.
PROMPT_S = 10.0
STREAM_S = 30.0


@dataclass
class Guarded:
    """The module's own server and the special files under its allowed root."""

    server: ServeProcess
    root: Path


@pytest.fixture(scope="module")
def guarded(serve_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    base = tmp_path_factory.mktemp("inputs")
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")
    # Under a short directory of its own: a unix socket's path is at most 107 bytes, and
    # pytest's temporary paths can be longer.
    root = Path(tempfile.mkdtemp(prefix="ectl-roots-"))
    for name in ("fifo", "socket", "devnull", "fifo-index"):
        (root / name).mkdir(parents=True)
    os.mkfifo(root / "fifo" / "model.safetensors")
    os.mkfifo(root / "fifo-index" / "model.safetensors.index.json")
    (root / "devnull" / "model.safetensors").symlink_to("/dev/null")
    sock_path = root / "socket" / "model.safetensors"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    srv = (
        ServeProcess(
            ["--token-file", str(token_file), "--allow-weights-from", str(root), "--allow-weights-from", "/dev"],
            serve_env,
        )
        .start()
        .wait_ready()
    )
    try:
        yield Guarded(srv, root.resolve())
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill()
            listener.close()
            shutil.rmtree(root, ignore_errors=True)


def _info(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> upb.GetServerInfoResponse:
    with grpc.insecure_channel(target) as channel:
        stub = upb_grpc.WeightUpdateServiceStub(channel)
        return stub.GetServerInfo(upb.GetServerInfoRequest(), metadata=metadata, timeout=PROMPT_S)


# --- GetServerInfo.allowed_weight_roots: the token's holder only ---------------------------------


def test_allowed_weight_roots_are_listed_only_to_the_tokens_holder(guarded: Guarded) -> None:
    target = guarded.server.grpc_target
    holder = _info(target, AUTH)
    assert holder.auth_required
    assert list(holder.allowed_weight_roots) == [str(guarded.root), "/dev"]
    for metadata in ((), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)):
        anonymous = _info(target, metadata)
        assert list(anonymous.allowed_weight_roots) == []
        # The rest of the answer is intact.
        anonymous.allowed_weight_roots.extend(holder.allowed_weight_roots)
        assert anonymous == holder


def test_server_without_token_lists_its_roots_to_everyone(server: ServeProcess) -> None:
    info = _info(server.grpc_target)
    assert not info.auth_required
    assert list(info.allowed_weight_roots) == [str(Path(server.model).resolve().parent)]


# --- disk updates: FIFOs, sockets and devices are refused from their stat -----------------------


class _Refusal:
    def __init__(self, err: EnginectlError, elapsed: float) -> None:
        self.err, self.elapsed = err, elapsed


def _disk_update(target: str, path: str) -> _Refusal:
    with grpc.insecure_channel(target) as channel:
        stub = upb_grpc.WeightUpdateServiceStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            stub.UpdateWeightsFromDisk(
                upb.UpdateWeightsFromDiskRequest(path=path, weight_version="special"), metadata=AUTH, timeout=PROMPT_S
            )
        return _Refusal(from_rpc_error(raised.value), time.monotonic() - started)


SPECIAL_FILES = {
    # name: (path under the root, or absolute; file_type reported; real path reported)
    "fifo file": ("fifo/model.safetensors", "fifo", "fifo/model.safetensors"),
    "directory holding a fifo": ("fifo", "fifo", "fifo/model.safetensors"),
    "fifo index": ("fifo-index", "fifo", "fifo-index/model.safetensors.index.json"),
    "unix socket": ("socket/model.safetensors", "socket", "socket/model.safetensors"),
    "directory holding a socket": ("socket", "socket", "socket/model.safetensors"),
    "symlink to /dev/null": ("devnull/model.safetensors", "character device", "/dev/null"),
    "/dev/null": ("/dev/null", "character device", "/dev/null"),
}


@pytest.mark.parametrize("case", list(SPECIAL_FILES))
def test_disk_update_refuses_a_special_file_at_once(case: str, guarded: Guarded) -> None:
    relative, file_type, real = SPECIAL_FILES[case]
    target = guarded.server.grpc_target
    with Client(target, token=TOKEN) as client:
        before = client.get_weight_version()
    with grpc.insecure_channel(target) as channel:
        ops = operations_pb2_grpc.OperationsStub(channel)
        ops_before = len(ops.ListOperations(operations_pb2.ListOperationsRequest(), metadata=AUTH).operations)
        refusal = _disk_update(target, str(guarded.root / relative))
        err = refusal.err
        # A hang would have ended in DEADLINE_EXCEEDED at PROMPT_S.
        assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.NOT_A_REGULAR_FILE), err
        assert refusal.elapsed < PROMPT_S / 2
        assert err.metadata["file_type"] == file_type
        assert err.metadata["real_path"] == str(guarded.root / real)  # "/dev/null" stays absolute
        assert [v.field for v in err.field_violations] == ["path"]
        # Nothing changed, and the server still answers.
        assert len(ops.ListOperations(operations_pb2.ListOperationsRequest(), metadata=AUTH).operations) == ops_before
        state = (
            upb_grpc.WeightUpdateServiceStub(channel)
            .GetGenerationState(upb.GetGenerationStateRequest(), timeout=PROMPT_S)
            .state
        )
        assert not state.paused and not state.update_operation
    with Client(target, token=TOKEN) as client:
        assert client.get_weight_version() == before


# --- ETAG_MISMATCH names the current etag ---------------------------------------------------------


@pytest.fixture
async def client(server: ServeProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.grpc_target, timeout=STREAM_S) as c:
        yield c


async def test_etag_mismatch_carries_the_current_etag_for_a_retry(client: AsyncClient) -> None:
    read = await client.get_weight_version()
    winner = await client.set_weight_version(f"winner-{uuid.uuid4().hex[:6]}", etag=read.etag)
    with pytest.raises(AbortedError) as raised:
        await client.set_weight_version("loser", etag=read.etag)
    err = raised.value
    assert err.reason == Reason.ETAG_MISMATCH
    assert err.current_etag == winner.etag
    assert err.metadata["current_revision"] == str(winner.revision)
    assert err.metadata["incarnation"] == winner.incarnation
    assert await client.get_weight_version() == winner
    # One round trip to retry: the etag from the refusal is current.
    retried = await client.set_weight_version("loser", etag=err.current_etag)
    assert (retried.version, retried.revision) == ("loser", winner.revision + 1)


def test_update_refused_for_its_etag_carries_the_current_etag(server: ServeProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        versions = vpb_grpc.WeightVersionServiceStub(channel)
        before = versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version
        with pytest.raises(grpc.RpcError) as raised:
            upb_grpc.WeightUpdateServiceStub(channel).UpdateWeightsFromDisk(
                upb.UpdateWeightsFromDiskRequest(path="/nonexistent", weight_version="x", etag="0" * 20),
                timeout=PROMPT_S,
            )
        err = from_rpc_error(raised.value)
        assert isinstance(err, AbortedError) and err.reason == Reason.ETAG_MISMATCH
        assert err.current_etag == before.etag
        assert versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version == before


# --- WatchWeightVersion resumes only within its incarnation --------------------------------------


async def _first(watch: AsyncIterator[WeightVersion]) -> WeightVersion:
    return await asyncio.wait_for(watch.__anext__(), STREAM_S)


async def test_watch_resumes_only_within_its_incarnation(guarded: Guarded, client: AsyncClient) -> None:
    # A watcher of the guarded server read revision `old` there; "after a restart" it meets
    # another incarnation (the shared server) whose revision is not behind `old`.
    async with AsyncClient(guarded.server.grpc_target, token=TOKEN, timeout=STREAM_S) as first:
        old = await first.set_weight_version(f"old-{uuid.uuid4().hex[:6]}")
    now = await client.get_weight_version()
    if now.revision < old.revision:
        now = await client.set_weight_version("catch-up")
    assert now.incarnation != old.incarnation and now.revision >= old.revision

    watch = client.watch_weight_version(since_revision=old.revision, incarnation=old.incarnation)
    with pytest.raises(OutOfRangeError) as raised:
        await _first(watch)
    assert raised.value.reason == Reason.INCARNATION_CHANGED
    assert raised.value.metadata["incarnation"] == now.incarnation
    assert await client.get_weight_version() == now

    # Within its incarnation the watch resumes (replaying what it missed); without an
    # incarnation it works as before.
    for incarnation in (now.incarnation, None):
        declared = await client.set_weight_version(f"resumed-{uuid.uuid4().hex[:6]}")
        watch = client.watch_weight_version(since_revision=now.revision, incarnation=incarnation)
        seen = await _first(watch)
        assert (seen.version, seen.revision, seen.incarnation) == (declared.version, now.revision + 1, now.incarnation)
        await watch.aclose()  # type: ignore[attr-defined]
        now = declared


def test_sync_client_watch_takes_an_incarnation(server: ServeProcess) -> None:
    with Client(server.grpc_target, timeout=STREAM_S) as client:
        now = client.get_weight_version()
        with pytest.raises(OutOfRangeError) as raised:
            next(iter(client.watch_weight_version(since_revision=now.revision, incarnation="another-start")))
        assert raised.value.reason == Reason.INCARNATION_CHANGED
        stream = client.watch_weight_version(since_revision=now.revision, incarnation=now.incarnation)
        declared = client.set_weight_version(f"sync-{uuid.uuid4().hex[:6]}")
        seen = next(iter(stream))
        assert (seen.version, seen.revision) == (declared.version, declared.revision)
        stream.close()  # type: ignore[attr-defined]


# --- versions refuse control characters ----------------------------------------------------------

CONTROL = {"NUL": "\x00", "LF": "\n", "ESC": "\x1b", "DEL": "\x7f", "NEL (C1)": "\x85", "APC (C1)": "\x9f"}


@pytest.mark.parametrize("name", list(CONTROL))
async def test_set_weight_version_refuses_control_characters(name: str, client: AsyncClient) -> None:
    before = await client.get_weight_version()
    with pytest.raises(InvalidArgumentError) as raised:
        await client.set_weight_version(f"step-1{CONTROL[name]}forged")
    assert raised.value.reason == Reason.VERSION_INVALID
    assert [v.field for v in raised.value.field_violations] == ["version"]
    assert await client.get_weight_version() == before


async def test_printable_unicode_versions_are_still_versions(client: AsyncClient) -> None:
    for version in ("step 7 ✓", "ünïcode-版本", "tab-free\u00a0nbsp"):
        assert (await client.set_weight_version(version)).version == version


def test_every_update_request_refuses_a_version_with_control_characters(server: ServeProcess) -> None:
    spec = upb.TensorSpec(name="model.embed_tokens.weight", dtype=upb.TENSOR_DTYPE_FLOAT32, shape=[1])
    requests = {
        "disk": upb.UpdateWeightsFromDiskRequest(path="/nonexistent", weight_version="v\n1"),
        "distributed": upb.UpdateWeightsFromDistributedRequest(
            group_name="g", tensors=[spec], weight_version="v\x1b[31m"
        ),
        "tensors": upb.TensorStreamHeader(tensors=[spec], weight_version="v\x00"),
    }
    with grpc.insecure_channel(server.grpc_target) as channel:
        updates = upb_grpc.WeightUpdateServiceStub(channel)
        ops = operations_pb2_grpc.OperationsStub(channel)
        versions = vpb_grpc.WeightVersionServiceStub(channel)
        before = versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version
        ops_before = len(ops.ListOperations(operations_pb2.ListOperationsRequest()).operations)
        for kind, request in requests.items():
            with pytest.raises(grpc.RpcError) as raised:
                if kind == "disk":
                    updates.UpdateWeightsFromDisk(request, timeout=PROMPT_S)
                elif kind == "distributed":
                    updates.UpdateWeightsFromDistributed(request, timeout=PROMPT_S)
                else:
                    updates.UpdateWeightsFromTensors(
                        iter([upb.UpdateWeightsFromTensorsRequest(header=request)]), timeout=PROMPT_S
                    )
            err = from_rpc_error(raised.value)
            assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.VERSION_INVALID), kind
            assert [v.field for v in err.field_violations] == ["weight_version"], kind
        assert versions.GetWeightVersion(vpb.GetWeightVersionRequest()).weight_version == before
        assert len(ops.ListOperations(operations_pb2.ListOperationsRequest()).operations) == ops_before


# --- the bounds table ----------------------------------------------------------------------------


def test_server_info_reports_the_bounds_table_and_the_documented_defaults(server: ServeProcess) -> None:
    reported = _info(server.grpc_target).limits
    assert (
        reported.max_version_bytes,
        reported.max_path_bytes,
        reported.max_group_name_bytes,
        reported.max_tensor_name_bytes,
        reported.max_tensors_per_update,
        reported.max_shape_rank,
        reported.max_tensor_elements,
        reported.max_chunk_bytes,
        reported.max_request_bytes,
        reported.max_update_groups,
        reported.max_retained_operations,
    ) == (
        limits.MAX_VERSION_BYTES,
        limits.MAX_PATH_BYTES,
        limits.MAX_GROUP_NAME_BYTES,
        limits.MAX_TENSOR_NAME_BYTES,
        limits.MAX_TENSORS,
        limits.MAX_SHAPE_RANK,
        limits.MAX_TENSOR_ELEMENTS,
        limits.MAX_CHUNK_BYTES,
        limits.MAX_MESSAGE_BYTES,
        limits.MAX_GROUPS,
        limits.MAX_RETAINED,
    )
    assert reported.default_timeout.seconds == limits.DEFAULT_TIMEOUT_S
    assert reported.max_timeout.seconds == limits.MAX_TIMEOUT_S
    # The defaults ServerLimits documents (weight_update_service.proto).
    assert (
        reported.max_tensors_per_update,
        reported.max_update_groups,
        reported.max_timeout.seconds,
        reported.default_timeout.seconds,
    ) == (262_144, 8, 24 * 3600, 600)


async def test_request_id_is_bounded_even_when_it_parses_as_a_uuid(client: AsyncClient) -> None:
    before = await client.get_weight_version()
    padded = "-" * 200 + str(uuid.uuid4())  # uuid.UUID() drops every hyphen
    with pytest.raises(InvalidArgumentError) as raised:
        await client.set_weight_version("padded", request_id=padded)
    assert raised.value.reason == Reason.REQUEST_ID_INVALID
    assert await client.get_weight_version() == before
