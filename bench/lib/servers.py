"""Baseline gRPC servers for the benchmark, without vLLM: `python -m bench.lib.servers --variant V`.

Runs in its own subprocess, started by `python -m bench`. Prints one JSON `serving` line
with its port, then serves on 127.0.0.1 until SIGTERM/SIGINT.

Variants, each adding one layer of what `enginectl serve` has:
- `bare`: grpc.aio server on the default asyncio loop, no options, no interceptors; a
  minimal WeightVersionServiceServicer whose GetWeightVersion returns a prebuilt response
  (the same message enginectl answers on an idle server). The baseline of the latency and throughput targets.
- `bare-uvloop`: the same on uvloop (the loop `enginectl serve` runs on).
- `intercepted-nolog`: bare-uvloop + enginectl's RpcInterceptor as `enginectl serve`
  runs it by default (successful reads are not logged): the interceptor's wrapping alone.
- `intercepted`: bare-uvloop + enginectl's RpcInterceptor logging one JSON line per
  RPC to stdout, as `enginectl serve --log-json --log-rpc-reads` does.
- `controlplane`: enginectl's whole ControlPlaneServer (real servicer and ledger, health,
  reflection, server options, interceptor, JSON logs) on uvloop, but no vLLM in the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import grpc

from enginectl.server.weights.convert import weight_version_proto
from enginectl.server.weights.version.ledger import WeightVersionLedger
from enginectl.weights.v1 import weight_version_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_service_pb2_grpc as pb2_grpc

VARIANTS = ("bare", "bare-uvloop", "intercepted-nolog", "intercepted", "controlplane")


class ConstantServicer(pb2_grpc.WeightVersionServiceServicer):
    """GetWeightVersion answers a prebuilt response; nothing else is implemented."""

    def __init__(self, response: pb2.GetWeightVersionResponse) -> None:
        self._response = response

    async def GetWeightVersion(self, request, context):  # the gRPC method name
        return self._response


def announce(port: int) -> None:
    print(json.dumps({"event": "serving", "grpc_port": port, "pid": os.getpid()}), flush=True)


async def run(variant: str, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    ledger = WeightVersionLedger()  # an idle enginectl server's state: nothing declared
    if variant == "controlplane":
        from enginectl.server.flags import configure_logging
        from enginectl.server.grpc_server import ControlPlaneServer

        configure_logging(True)
        plane = ControlPlaneServer(ledger)
        bound = await plane.start(host, port)
        await plane.set_serving(True)
        announce(bound)
        await stop.wait()
        await plane.stop(1.0)
        return 0

    interceptors = []
    if variant.startswith("intercepted"):
        from enginectl.server.flags import configure_logging
        from enginectl.server.interceptors import RpcInterceptor

        configure_logging(True)
        interceptors.append(RpcInterceptor(log_reads=variant == "intercepted"))
    server = grpc.aio.server(interceptors=interceptors or None)
    response = pb2.GetWeightVersionResponse(weight_version=weight_version_proto(ledger.state))
    pb2_grpc.add_WeightVersionServiceServicer_to_server(ConstantServicer(response), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    announce(bound)
    await stop.wait()
    await server.stop(1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lib.servers")
    parser.add_argument("--variant", choices=VARIANTS, default="bare")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.variant == "bare":
        return asyncio.run(run(args.variant, args.host, args.port))
    import uvloop

    return uvloop.run(run(args.variant, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
