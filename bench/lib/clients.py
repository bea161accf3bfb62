"""Load generators of the benchmark: `python -m bench.lib.clients latency|throughput|rollouts`.

Each runs in its own subprocess (never in a server's process), started by `python -m bench`,
and reports JSON lines on stdout (`ready`, `started`, `result`, or `error`). Every loop is
bounded in count and in time.

- latency: one client per target, each on its own keep-alive connection (a blocking gRPC
  channel, or an http.client connection); targets are measured in interleaved blocks so that
  machine noise falls on all of them alike.
- throughput: N concurrent clients, each with its own channel/connection (grpc.aio, or
  aiohttp for HTTP), running for a window that starts when the parent writes `go`.
- rollouts: S concurrent streaming requests of a fixed token count, looping until the parent
  writes `stop` (or the time bound): /v1/completions on vLLM's HTTP API (`--via http`, the
  default; `--usage` counts tokens by the stream's usage, for a server such as the SMG
  gateway that merges tokens into one event) or Generate of vLLM's gRPC engine service on the
  control port (`--via grpc`). Each records tokens/s over the load window and every request's
  time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from bench.lib.lines import emit, report_errors
from bench.lib.stats import summarize_ms


def _parse_target(spec: str) -> tuple[str, str, str, str]:
    """`name=grpc:host:port` or `name=http:host:port/path` -> (name, kind, hostport, path)."""
    name, _, rest = spec.partition("=")
    kind, _, addr = rest.partition(":")
    if kind not in ("grpc", "http") or not name or not addr:
        raise SystemExit(f"bad target {spec!r}")
    hostport, slash, path = addr.partition("/")
    return name, kind, hostport, (slash + path) if slash else ""


# -- latency -------------------------------------------------------------------------------
@dataclass
class _Probe:
    name: str
    kind: str
    hostport: str
    path: str
    samples: list[float] = field(default_factory=list)
    errors: int = 0
    reconnects: int = 0
    last_error: str = ""

    def __post_init__(self) -> None:
        if self.kind == "grpc":
            import grpc

            from enginectl.weights.v1 import weight_version_service_pb2 as pb2
            from enginectl.weights.v1 import weight_version_service_pb2_grpc as pb2_grpc

            self._channel = grpc.insecure_channel(self.hostport)
            grpc.channel_ready_future(self._channel).result(timeout=30)
            self._call = pb2_grpc.WeightVersionServiceStub(self._channel).GetWeightVersion
            self._request = pb2.GetWeightVersionRequest()
        else:
            host, _, port = self.hostport.rpartition(":")
            self._conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def once(self) -> float:
        """One call; returns its latency in seconds (raises on failure)."""
        if self.kind == "grpc":
            t0 = time.perf_counter()
            self._call(self._request, timeout=30)
            return time.perf_counter() - t0
        for attempt in (0, 1):
            try:
                t0 = time.perf_counter()
                self._conn.request("GET", self.path)
                resp = self._conn.getresponse()
                resp.read()
                dt = time.perf_counter() - t0
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if attempt:  # the keep-alive connection was closed under us twice in a row
                    raise
                self.reconnects += 1
                self._conn.close()
                continue
            if resp.status != 200:
                raise RuntimeError(f"{self.path}: HTTP {resp.status}")
            if resp.will_close:
                self.reconnects += 1
            return dt
        raise AssertionError("unreachable")

    def measure(self, n: int, keep: bool) -> None:
        for _ in range(n):
            try:
                dt = self.once()
            except Exception as err:  # counted and reported; re-raised past 20
                self.errors += 1
                self.last_error = repr(err)[:200]
                if self.errors > 20:
                    raise
                continue
            if keep:
                self.samples.append(dt)

    def close(self) -> None:
        if self.kind == "grpc":
            self._channel.close()
        else:
            self._conn.close()


def cmd_latency(args: argparse.Namespace) -> None:
    probes = [_Probe(*_parse_target(spec)) for spec in args.target]
    for p in probes:
        p.measure(args.warmup, keep=False)
    gc.collect()
    gc.disable()  # no collector pauses inside timed calls (the same for every target)
    t0 = time.monotonic()
    deadline = t0 + args.max_seconds
    truncated = False
    while any(len(p.samples) < args.samples for p in probes):
        if time.monotonic() > deadline:
            truncated = True
            break
        for p in probes:
            left = args.samples - len(p.samples)
            if left > 0:
                p.measure(min(args.block, left), keep=True)
    gc.enable()
    elapsed = time.monotonic() - t0
    for p in probes:
        p.close()
    emit(
        "result",
        elapsed_s=round(elapsed, 3),
        truncated=truncated,
        targets={
            p.name: {
                **summarize_ms(p.samples),
                "errors": p.errors,
                "reconnects": p.reconnects,
                "last_error": p.last_error,
            }
            for p in probes
        },
    )


# -- throughput ----------------------------------------------------------------------------
async def _throughput(args: argparse.Namespace) -> None:
    name, kind, hostport, path = _parse_target(args.target)
    stop = False
    measuring = False
    counts = [0] * args.clients
    errors = [0] * args.clients
    latencies: list[float] = []

    if kind == "grpc":
        import grpc

        from enginectl.weights.v1 import weight_version_service_pb2 as pb2
        from enginectl.weights.v1 import weight_version_service_pb2_grpc as pb2_grpc

        # A local subchannel pool gives every client its own TCP connection.
        channels = [
            grpc.aio.insecure_channel(hostport, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(args.clients)
        ]
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), 30)
        request = pb2.GetWeightVersionRequest()
        calls = [pb2_grpc.WeightVersionServiceStub(c).GetWeightVersion for c in channels]

        async def one(i: int) -> None:
            await calls[i](request, timeout=30)

        async def close() -> None:
            await asyncio.gather(*(c.close() for c in channels))
    else:
        import aiohttp

        url = f"http://{hostport}{path}"
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in range(args.clients)]

        async def one(i: int) -> None:
            async with sessions[i].get(url) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")

        async def close() -> None:
            await asyncio.gather(*(s.close() for s in sessions))

    async def client(i: int) -> None:
        while not stop:
            t0 = time.perf_counter()
            try:
                await one(i)
            except Exception:  # counted; re-raised past 50
                errors[i] += 1
                if errors[i] > 50:
                    raise
                continue
            if measuring:
                counts[i] += 1
                latencies.append(time.perf_counter() - t0)

    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(client(i)) for i in range(args.clients)]
    try:
        await asyncio.sleep(args.warmup_seconds)  # load runs; not a readiness wait
        emit("ready", target=name)
        go = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), args.max_seconds)
        if go.strip() != "go":
            raise RuntimeError(f"expected 'go', got {go!r}")
        gc.collect()
        gc.disable()
        measuring = True
        t0 = time.perf_counter()
        await asyncio.sleep(args.seconds)  # the measurement window
        measuring = False
        window = time.perf_counter() - t0
        gc.enable()
        stop = True
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close()
    total = sum(counts)
    emit(
        "result",
        target=name,
        clients=args.clients,
        window_s=round(window, 3),
        requests=total,
        rps=round(total / window, 1),
        errors=sum(errors),
        latency=summarize_ms(latencies),
    )


def cmd_throughput(args: argparse.Namespace) -> None:
    asyncio.run(_throughput(args))


# -- rollouts ------------------------------------------------------------------------------
# One rollout request: a generator that sends it when first advanced, yields the number of
# tokens each message brings, returns once the completion is whole and raises on failure;
# closing it early cancels the request.
Request = Callable[[int, int], Generator[int, None, None]]


def _http_completions(args: argparse.Namespace) -> tuple[Request, Callable[[], None]]:
    """Streaming /v1/completions on vLLM's HTTP API (or any OpenAI-compatible one, e.g. the SMG
    gateway's), a new connection per request; one SSE event is one token (vLLM streams a token
    per event unless its consumer lags). With `--usage` the stream also ends with its usage
    (`stream_options.include_usage`), and the tokens it counts that no event did are added
    then: SMG merges tokens into one event until their text is whole."""
    host, _, port = args.http.rpartition(":")
    request_body = {
        "model": args.model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "min_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    if args.usage:
        request_body["stream_options"] = {"include_usage": True}
    body = json.dumps(request_body)

    def request(stream: int, seq: int) -> Generator[int, None, None]:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            got = 0
            while line := resp.readline():
                if line.startswith(b"data: [DONE]"):
                    return
                if not line.startswith(b"data: "):
                    continue
                if args.usage and (b'"usage":{' in line or b'"usage": {' in line):
                    total = int(json.loads(line[6:])["usage"]["completion_tokens"])
                    if total > got:
                        yield total - got
                    got = max(got, total)
                else:
                    got += 1
                    yield 1
            raise RuntimeError("stream ended before [DONE]")
        finally:
            conn.close()

    return request, lambda: None


def _grpc_generate(args: argparse.Namespace) -> tuple[Request, Callable[[], None]]:
    """Streaming Generate of vLLM's gRPC engine service (vllm.grpc.engine.VllmEngine) on the
    enginectl control port, the same prompt as text; one channel (and TCP connection) per
    stream, kept across its requests."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2 as pb2
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb2_grpc

    channels = [
        grpc.insecure_channel(args.grpc, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(args.streams)
    ]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    stubs = [pb2_grpc.VllmEngineStub(channel) for channel in channels]
    params = pb2.SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True, temperature=0.0
    )

    def request(stream: int, seq: int) -> Generator[int, None, None]:
        generate = pb2.GenerateRequest(
            request_id=f"bench-{os.getpid()}-{stream}-{seq}", text=args.prompt, sampling_params=params, stream=True
        )
        call = stubs[stream].Generate(generate, timeout=60)
        complete = False
        try:
            for response in call:  # chunks (token_ids), then `complete`, then the status
                if response.HasField("chunk"):
                    yield len(response.chunk.token_ids)
                elif response.HasField("complete"):
                    complete = True
            if not complete:
                raise RuntimeError("Generate ended without `complete`")
        finally:
            call.cancel()  # a no-op once the call ended; otherwise vLLM aborts the request

    def close() -> None:
        for channel in channels:
            channel.close()

    return request, close


def cmd_rollouts(args: argparse.Namespace) -> None:
    if (args.via == "grpc" and not args.grpc) or (args.via == "http" and not (args.http and args.model)):
        raise SystemExit(f"--via {args.via} needs " + ("--grpc" if args.via == "grpc" else "--http and --model"))
    request, close = _grpc_generate(args) if args.via == "grpc" else _http_completions(args)
    stop = threading.Event()
    lock = threading.Lock()
    first = threading.Event()
    streams_started: set[int] = set()
    done = {"completions": 0, "tokens": 0, "errors": 0, "tokens_short": 0}
    durations: list[float] = []
    ttfts: list[tuple[float, float]] = []  # (request sent, time to its first token), perf_counter
    last_error = [""]
    t_start = time.monotonic()
    deadline = t_start + args.max_seconds

    def stream(i: int) -> None:
        seq = 0
        while not stop.is_set() and time.monotonic() < deadline:
            seq += 1
            t0 = time.perf_counter()
            got = 0
            tokens = request(i, seq)
            try:
                for n in tokens:
                    if stop.is_set():
                        break
                    now = time.perf_counter()
                    with lock:
                        done["tokens"] += n
                        if not got and n:
                            ttfts.append((t0, now - t0))
                            streams_started.add(i)
                            if len(streams_started) == args.streams:
                                first.set()
                    got += n
                else:
                    with lock:
                        done["completions"] += 1
                        done["tokens_short"] += max(0, args.max_tokens - got)  # tokens merged into one message
                        durations.append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - counted
                if not stop.is_set():
                    with lock:
                        done["errors"] += 1
                        last_error[0] = repr(exc)[:300]
                    if done["errors"] > 10:
                        stop.set()
            finally:
                tokens.close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    if not first.wait(min(120.0, args.max_seconds)):
        stop.set()
        emit("error", message=f"streams did not all start: {done}, last error {last_error[0]!r}")
        return
    emit("started", streams=args.streams, after_s=round(time.monotonic() - t_start, 3))
    t_load = time.monotonic()
    t_load_perf = time.perf_counter()
    cpu_at_start = time.process_time()
    tokens_at_start = done["tokens"]
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            sys.stdin.readline()  # "stop" or EOF
            break
    stop.set()
    load_s = time.monotonic() - t_load
    tokens_in_load = done["tokens"] - tokens_at_start
    client_cpu_s = time.process_time() - cpu_at_start  # this process, all its threads
    for t in threads:
        t.join(65)
    close()
    durations.sort()
    # Time to first token of the requests sent once every stream ran (the load window).
    ttft = [dt for sent, dt in ttfts if sent >= t_load_perf]
    emit(
        "result",
        via=args.via,
        streams=args.streams,
        max_tokens=args.max_tokens,
        load_s=round(load_s, 3),
        completions=done["completions"],
        tokens=done["tokens"],
        tokens_short=done["tokens_short"],
        errors=done["errors"],
        last_error=last_error[0],
        tokens_per_s=round(tokens_in_load / load_s, 1) if load_s else None,
        client_cpu_ms_per_1k_tokens=round(client_cpu_s * 1e6 / tokens_in_load, 1) if tokens_in_load else None,
        completion_s_p50=round(durations[len(durations) // 2], 3) if durations else None,
        ttft=summarize_ms(ttft),
        **({"ttft_s": [round(dt, 6) for dt in ttft]} if args.ttft_samples else {}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lib.clients")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("latency")
    p.add_argument("--target", action="append", required=True)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=60.0)
    p = sub.add_parser("throughput")
    p.add_argument("--target", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p = sub.add_parser("rollouts")
    p.add_argument("--via", choices=("http", "grpc"), default="http", help="HTTP /v1/completions or gRPC Generate")
    p.add_argument("--http", help="host:port of vLLM's HTTP API (--via http)")
    p.add_argument("--model", help="the served model's name (--via http)")
    p.add_argument("--grpc", help="host:port of the enginectl control port (--via grpc)")
    p.add_argument("--ttft-samples", action="store_true", help="report every time to first token too")
    p.add_argument("--usage", action="store_true", help="count tokens by the stream's usage (--via http)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Once upon a time")
    p.add_argument("--max-seconds", type=float, default=180.0)
    args = parser.parse_args(argv)
    command = {"latency": cmd_latency, "throughput": cmd_throughput, "rollouts": cmd_rollouts}[args.cmd]
    return report_errors(lambda: command(args))


if __name__ == "__main__":
    sys.exit(main())
