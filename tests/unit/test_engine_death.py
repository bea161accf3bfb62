"""A dead engine is never hidden, on an in-process server with no engine: the switch a real
engine's death throws (`ControlPlaneServer.engine_dead`) refuses every RPC of every service
with UNAVAILABLE `ENGINE_DEAD` and ends open streams with it, while health (NOT_SERVING) and
reflection stay open. A real EngineCore is killed in tests/e2e/test_engine_death.py.

Every wait has a deadline: streams are read with gRPC deadlines.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from enginectl.client.errors import Reason, from_rpc_error
from enginectl.server.grpc_server import ControlPlaneServer
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_version_service_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as wv_grpc

VERSION = "policy-7"


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _refusal(
    channel: grpc.aio.Channel, service: str, method: str, client_streaming: bool, server_streaming: bool
) -> tuple[grpc.StatusCode, str]:
    """Call `method` with an empty request (raw bytes: no stub needed); its (code, reason)."""
    path = f"/{service}/{method}"
    try:
        if server_streaming:
            stream = channel.stream_stream(path)(iter([b""])) if client_streaming else channel.unary_stream(path)(b"")
            async for _ in stream:
                pass
        elif client_streaming:
            await channel.stream_unary(path)(iter([b""]))
        else:
            await channel.unary_unary(path)(b"")
    except grpc.RpcError as rpc_err:
        err = from_rpc_error(rpc_err)
        return err.code, err.reason
    return grpc.StatusCode.OK, ""


async def test_a_dead_engine_refuses_every_rpc_but_health_and_reflection() -> None:
    plane = ControlPlaneServer(WeightVersionLedger())
    port = await plane.start("127.0.0.1", 0)
    await plane.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            versions = wv_grpc.WeightVersionServiceStub(channel)
            await versions.SetWeightVersion(wv_pb2.SetWeightVersionRequest(version=VERSION), timeout=10)
            watch = versions.WatchWeightVersion(wv_pb2.WatchWeightVersionRequest(), timeout=30)
            assert (await watch.read()).weight_version.version == VERSION

            await plane.engine_dead("EngineCore_DP0 (pid 1) was killed by SIGKILL")
            with pytest.raises(grpc.RpcError) as ended:
                await watch.read()
            err = from_rpc_error(ended.value)
            assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD), err
            assert "SIGKILL" in err.message  # the cause travels with the refusal

            pool = descriptor_pool.Default()
            refusals = {}
            for name in plane.service_names:
                for m in pool.FindServiceByName(name).methods:
                    refusals[f"{name}/{m.name}"] = await _refusal(
                        channel, name, m.name, m.client_streaming, m.server_streaming
                    )
            assert len(refusals) > 10 and "enginectl.weights.v1.WeightVersionService/GetWeightVersion" in refusals
            assert {
                rpc: r for rpc, r in refusals.items() if r != (grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD)
            } == {}

            health = health_pb2_grpc.HealthStub(channel)
            await plane.set_serving(True)  # nothing brings a dead engine's server back
            for service in ("", *plane.service_names):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert answer.status == NOT_SERVING, service
            listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            async for response in listing:
                listed = {s.name for s in response.list_services_response.service}
                assert "enginectl.weights.v1.WeightVersionService" in listed
                break
    finally:
        await plane.stop(0)
