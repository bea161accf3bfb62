"""WeightVersionService on a real engine, through the typed client and raw stubs.

Runs against the session's shared server: assertions are relative to the state each test
finds (the fresh-incarnation case is covered in test_serve_blackbox.py).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from support.serving import ServeProcess

from enginectl.client import (
    AbortedError,
    AsyncClient,
    Client,
    InvalidArgumentError,
    OutOfRangeError,
    Reason,
    WeightSource,
)
from enginectl.weights.v1 import weight_version_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as pb2_grpc


@pytest.fixture
async def client(server: ServeProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.grpc_target, timeout=30) as c:
        yield c


async def test_declarations_read_back_exactly_with_consecutive_revisions(client: AsyncClient) -> None:
    start = await client.get_weight_version()
    for i, version in enumerate(["initial", "default", "0", "step 7 ✓"], start=1):
        declared = await client.set_weight_version(version)
        read = await client.get_weight_version()
        assert read == declared
        assert (read.declared, read.version, read.revision) == (True, version, start.revision + i)
        assert read.source is WeightSource.DECLARED and read.declare_time is not None
        assert read.incarnation == start.incarnation


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        ("", Reason.VERSION_REQUIRED),
        ("v" * 257, Reason.VERSION_TOO_LONG),
        ("ü" * 129, Reason.VERSION_TOO_LONG),  # 258 bytes of UTF-8
    ],
    ids=["empty", "257-ascii", "258-utf8-bytes"],
)
async def test_bad_version_is_invalid_argument_and_changes_nothing(
    client: AsyncClient, version: str, reason: str
) -> None:
    before = await client.set_weight_version(f"before-{uuid.uuid4()}")
    with pytest.raises(InvalidArgumentError) as err:
        await client.set_weight_version(version)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == reason
    assert [v.field for v in err.value.field_violations] == ["version"]
    assert await client.get_weight_version() == before


async def test_missing_version_field_on_the_wire(server: ServeProcess) -> None:
    """A request with no version field at all (raw stub, not the typed client)."""
    from grpc_status import rpc_status

    from enginectl.client.errors import status_details

    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = pb2_grpc.WeightVersionServiceStub(channel)
        before = (await stub.GetWeightVersion(pb2.GetWeightVersionRequest())).weight_version
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SetWeightVersion(pb2.SetWeightVersionRequest())
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(err.value)
        reason, meta, violations = status_details(status)
        assert reason == Reason.VERSION_REQUIRED
        after = (await stub.GetWeightVersion(pb2.GetWeightVersionRequest())).weight_version
        assert after == before


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\x02\xff\xfe", b"\x0a\x05abc"],
    ids=["version-not-utf8", "truncated"],
)
async def test_unparseable_request_is_invalid_argument(server: ServeProcess, raw: bytes) -> None:
    """Bytes no client library would send; gRPC alone would answer UNKNOWN."""
    from grpc_status import rpc_status

    from enginectl.client.errors import status_details

    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = pb2_grpc.WeightVersionServiceStub(channel)
        before = (await stub.GetWeightVersion(pb2.GetWeightVersionRequest())).weight_version
        call = channel.unary_unary(
            "/enginectl.weights.v1.WeightVersionService/SetWeightVersion",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(raw, timeout=30)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        reason, _, _ = status_details(rpc_status.from_call(err.value))
        assert reason == Reason.MALFORMED_REQUEST
        assert (await stub.GetWeightVersion(pb2.GetWeightVersionRequest())).weight_version == before


async def test_stale_etag_is_aborted_and_current_etag_applies(client: AsyncClient) -> None:
    first = await client.set_weight_version("cas-1")
    second = await client.set_weight_version("cas-2", etag=first.etag)
    assert second.revision == first.revision + 1 and second.etag != first.etag
    with pytest.raises(AbortedError) as err:
        await client.set_weight_version("cas-3", etag=first.etag)
    assert err.value.reason == Reason.ETAG_MISMATCH
    assert await client.get_weight_version() == second


@pytest.mark.parametrize("request_id", ["not-a-uuid", "1234", "x" * 300])
async def test_malformed_request_id_is_invalid_argument(client: AsyncClient, request_id: str) -> None:
    before = await client.set_weight_version(f"rid-{uuid.uuid4()}")
    with pytest.raises(InvalidArgumentError) as err:
        await client.set_weight_version("never", request_id=request_id)
    assert err.value.reason == Reason.REQUEST_ID_INVALID
    assert [v.field for v in err.value.field_violations] == ["request_id"]
    assert await client.get_weight_version() == before


async def test_retried_request_id_returns_first_answer(client: AsyncClient) -> None:
    rid = str(uuid.uuid4())
    first = await client.set_weight_version("retry-me", request_id=rid)
    retried = await client.set_weight_version("retry-me", request_id=rid)
    assert retried == first
    assert (await client.get_weight_version()).revision == first.revision
    with pytest.raises(InvalidArgumentError) as err:
        await client.set_weight_version("something-else", request_id=rid)
    assert err.value.reason == Reason.REQUEST_ID_REUSED
    assert (await client.get_weight_version()).revision == first.revision


async def test_watch_sees_current_then_every_declaration_in_order_once(client: AsyncClient) -> None:
    watch = client.watch_weight_version()
    current = await asyncio.wait_for(anext(watch), 30)
    assert current == await client.get_weight_version()
    versions = [f"watch-{i}" for i in range(5)]
    for v in versions:
        await client.set_weight_version(v)
    seen = [await asyncio.wait_for(anext(watch), 30) for _ in versions]
    await watch.aclose()
    assert [s.version for s in seen] == versions
    assert [s.revision for s in seen] == list(range(current.revision + 1, current.revision + 6))


async def test_watch_resumes_after_revision(client: AsyncClient) -> None:
    base = await client.set_weight_version("resume-base")
    await client.set_weight_version("resume-1")
    await client.set_weight_version("resume-2")
    watch = client.watch_weight_version(since_revision=base.revision)
    seen = [await asyncio.wait_for(anext(watch), 30) for _ in range(2)]
    await watch.aclose()
    assert [s.version for s in seen] == ["resume-1", "resume-2"]
    future = client.watch_weight_version(since_revision=base.revision + 1000)
    with pytest.raises(OutOfRangeError) as err:
        await asyncio.wait_for(anext(future), 30)
    assert err.value.reason == Reason.REVISION_IN_FUTURE


def test_sync_client(server: ServeProcess) -> None:
    with Client(server.grpc_target) as c:
        state = c.set_weight_version("sync-client")
        assert c.get_weight_version() == state
        watch = c.watch_weight_version()
        assert next(watch) == state
        watch.close()
        with pytest.raises(InvalidArgumentError):
            c.set_weight_version("")


def _generate(server: ServeProcess, prompt_ids: list[int], max_tokens: int = 6) -> dict:
    body = json.dumps(
        {
            "token_ids": prompt_ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
        }
    ).encode()
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


async def test_declared_version_stamps_generated_outputs(client: AsyncClient, server: ServeProcess) -> None:
    """RequestOutput.weight_versions, as vLLM's own /inference/v1/generate reports it."""
    for version in ("stamp-a", "stamp-b"):
        await client.set_weight_version(version)
        out = await asyncio.to_thread(_generate, server, [1, 43, 375, 82])
        choice = out["choices"][0]
        n = len(choice["token_ids"])
        assert n > 0
        assert choice["weight_versions"] == [{"version": version, "start": 0, "end": n}]


async def test_server_info_describes_engine_and_supported_rpcs(server: ServeProcess) -> None:
    from enginectl.weights.v1 import weight_update_service_pb2, weight_update_service_pb2_grpc

    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = weight_update_service_pb2_grpc.WeightUpdateServiceStub(channel)
        info = await stub.GetServerInfo(weight_update_service_pb2.GetServerInfoRequest())
    assert info.model == server.model
    assert info.dtype == weight_update_service_pb2.TENSOR_DTYPE_FLOAT32
    assert (info.data_parallel_size, info.tensor_parallel_size, info.num_workers) == (1, 1, 1)
    assert info.vllm_version.startswith("0.32")
    assert info.auth_required is False
    assert info.incarnation == server.serving["incarnation"]
    assert set(info.api_versions) == {
        "enginectl.weights.v1",
        "enginectl.fpm.v1",
        "google.longrunning",
        "vllm.grpc.engine",  # vLLM's VllmEngine: rollouts on the control port
    }
    # Every RPC of every service this server registers is implemented.
    from google.longrunning import operations_pb2
    from smg_grpc_proto import vllm_engine_pb2

    from enginectl.fpm.v1 import forward_pass_metrics_service_pb2, fpm_identity_service_pb2

    every = {
        f"{service.full_name}/{method.name}"
        for module in (
            pb2,
            weight_update_service_pb2,
            fpm_identity_service_pb2,
            forward_pass_metrics_service_pb2,
            operations_pb2,
            vllm_engine_pb2,
        )
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert set(info.supported_rpcs) == every
    assert info.limits.max_version_bytes == 256


def _metrics(server: ServeProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("enginectl_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_metrics_on_vllms_metrics_endpoint(client: AsyncClient, server: ServeProcess) -> None:
    set_ok = 'enginectl_rpcs_total{code="OK",rpc="/enginectl.weights.v1.WeightVersionService/SetWeightVersion"}'
    set_bad = 'enginectl_rpcs_total{code="INVALID_ARGUMENT",rpc="/enginectl.weights.v1.WeightVersionService/SetWeightVersion"}'
    before = await asyncio.to_thread(_metrics, server)
    state = await client.set_weight_version("metrics-1")
    with pytest.raises(InvalidArgumentError):
        await client.set_weight_version("")
    after = await asyncio.to_thread(_metrics, server)
    assert after[set_ok] == before.get(set_ok, 0) + 1
    assert after[set_bad] == before.get(set_bad, 0) + 1
    assert after["enginectl_weight_version_revision"] == state.revision
    assert after["enginectl_weight_version_declared"] == 1
