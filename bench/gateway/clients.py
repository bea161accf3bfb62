"""Load side of the gateway bench (bench/gateway/phase.py): `python -m bench.gateway.clients MODE`.

Runs in subprocesses of `python -m bench`, speaking JSON lines on stdout (bench/lib/lines.py):
- `pause --target T --http-port P --reps N`: pause + resume round trips, interleaved rep by rep
  and alternating which goes first: the HTTP RL routes on the server's HTTP port
  (`POST /pause?mode=keep`, `POST /resume`, one keep-alive http.client connection) vs the gRPC
  pair on its control port (PauseGeneration KEEP + ResumeGeneration, one keep-alive channel).
- `label-lag --target T --smg URL --url grpc://... --n N`: N declarations, one at a time:
  SetWeightVersion over gRPC, then `GET /v1/rl/workers` on SMG in a tight loop (keep-alive)
  until the server's row names the new version; the lag from the declaration's answer.
Both raw: generated stubs and http.client, so neither side pays a client library's layers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.parse
from typing import Any

from bench.lib.lines import emit, report_errors
from bench.lib.stats import summarize_ms

LABEL_LAG_TIMEOUT_S = 10.0  # a declaration SMG has not shown by then counts as lost


def _grpc_channel(target: str) -> Any:
    import grpc

    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel


def _post(conn: http.client.HTTPConnection, path: str) -> None:
    conn.request("POST", path, body=b"", headers={"Content-Length": "0"})
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"POST {path}: HTTP {resp.status}: {body[:300]!r}")


def cmd_pause(args: argparse.Namespace) -> None:
    from enginectl.weights.v1 import weight_update_service_pb2 as upd
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as upd_grpc

    channel = _grpc_channel(args.target)
    stub = upd_grpc.WeightUpdateServiceStub(channel)
    conn = http.client.HTTPConnection("127.0.0.1", args.http_port, timeout=60)
    pause = upd.PauseGenerationRequest(mode=upd.PAUSE_MODE_KEEP)
    resume = upd.ResumeGenerationRequest()

    def grpc_pair() -> float:
        t0 = time.perf_counter()
        stub.PauseGeneration(pause, timeout=60)
        stub.ResumeGeneration(resume, timeout=60)
        return time.perf_counter() - t0

    def http_pair() -> float:
        t0 = time.perf_counter()
        _post(conn, "/pause?mode=keep")
        _post(conn, "/resume")
        return time.perf_counter() - t0

    pairs = {"grpc": grpc_pair, "http": http_pair}
    for _ in range(args.warmup):
        for pair in pairs.values():
            pair()
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for rep in range(args.reps):
        order = ("grpc", "http") if rep % 2 == 0 else ("http", "grpc")
        for name in order:
            times[name].append(pairs[name]())
    conn.close()
    channel.close()
    emit("result", reps=args.reps, **{name: summarize_ms(t) for name, t in times.items()})


def cmd_label_lag(args: argparse.Namespace) -> None:
    from enginectl.weights.v1 import weight_version_service_pb2 as ver
    from enginectl.weights.v1 import weight_version_service_pb2_grpc as ver_grpc

    channel = _grpc_channel(args.target)
    stub = ver_grpc.WeightVersionServiceStub(channel)
    smg = urllib.parse.urlsplit(args.smg)
    conn = http.client.HTTPConnection(smg.hostname or "127.0.0.1", smg.port or 80, timeout=10)

    def label() -> str | None:
        conn.request("GET", "/v1/rl/workers")
        resp = conn.getresponse()
        rows = json.loads(resp.read())["workers"]
        return next((r.get("weight_version") for r in rows if r["url"] == args.url), None)

    lags: list[float] = []  # declaration answered -> SMG's row shows it
    from_call: list[float] = []  # declaration sent -> SMG's row shows it
    polls: list[int] = []
    lost = 0
    for i in range(args.n):
        version = f"gw-{os.getpid()}-{i}"
        t0 = time.perf_counter()
        stub.SetWeightVersion(ver.SetWeightVersionRequest(version=version), timeout=30)
        t1 = time.perf_counter()
        n = 0
        while True:
            n += 1
            if label() == version:
                t2 = time.perf_counter()
                break
            if time.perf_counter() - t1 > LABEL_LAG_TIMEOUT_S:
                t2 = 0.0
                break
        if not t2:
            lost += 1
            continue
        lags.append(t2 - t1)
        from_call.append(t2 - t0)
        polls.append(n)
    conn.close()
    channel.close()
    emit(
        "result",
        declarations=args.n,
        lost=lost,
        lag=summarize_ms(lags),
        lag_from_call=summarize_ms(from_call),
        polls_median=sorted(polls)[len(polls) // 2] if polls else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway.clients")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pause")
    p.add_argument("--target", required=True, help="host:port of the control port")
    p.add_argument("--http-port", type=int, required=True, help="the server's HTTP port (the RL routes)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p = sub.add_parser("label-lag")
    p.add_argument("--target", required=True, help="host:port of the control port")
    p.add_argument("--smg", required=True, help="SMG's URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--url", required=True, help="the server's worker URL in SMG (grpc://host:port)")
    p.add_argument("--n", type=int, default=50)
    args = parser.parse_args(argv)
    command = {"pause": cmd_pause, "label-lag": cmd_label_lag}[args.cmd]
    return report_errors(lambda: command(args))


if __name__ == "__main__":
    sys.exit(main())
