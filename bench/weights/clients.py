"""Load side of the weight-update bench (bench/weights/phase.py): `python -m bench.weights.clients MODE`.

Runs in subprocesses of `python -m bench`, speaking JSON lines on stdout:
- `build [--quick]`: build (once) both synthetic checkpoints (bench/lib/checkpoints.py); prints
  {"event": "result", "models": {key: dir}}.
- `run --target T --http-port P --vllm-http-port V --model DIR --reps N`: measures, interleaved
  rep by rep, each enginectl figure and its baseline on the same server and the same bytes (the
  pause's on the plain vLLM API server at V, idle as ours is: `enginectl serve` mounts
  enginectl's own /pause and /resume on its HTTP port, docs/http_routes.md):
    pause     PauseGeneration(KEEP) + ResumeGeneration  vs  vLLM HTTP /pause?mode=keep + /resume
    disk      UpdateWeightsFromDisk(DIR)                vs  vLLM /collective_rpc reload_weights(DIR)
    tensors   TrainerClient.update_weights_from_tensors vs  the same stream messages to a gRPC sink
    gloo      TrainerClient.broadcast_weights           vs  a raw gloo broadcast to another process
              (bucketed, the client's default, and one collective per tensor)
    ipc       TrainerClient.update_weights_from_ipc     vs  reload_weights over the same tensors
              held in the worker's memory (bench/lib/worker_ext.py, timed in the worker)
  and, in the same run, the physical floors (bench/weights/floors.py): GetGenerationState between the
  pause reps, and the memcpy bandwidth of the checkpoint's tensors into reused buffers.
- `sink`: a bare grpc server whose one client-streaming method drops what it receives.
- `gloo-recv --port P --file F --reps N`: rank 1 of a raw two-process gloo group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from bench.lib import checkpoints
from bench.lib.lines import emit
from bench.weights import floors
from bench.weights.transfer import measure_transfer
from enginectl.client.trainer import DEFAULT_BUCKET_BYTES
from enginectl.common import buckets

SINK_METHOD = "/bench.Sink/Stream"
CHUNK_BYTES = 2 * 1024 * 1024


# -- baselines ---------------------------------------------------------------------------------
def sink() -> None:
    """A bare grpc server: one client-streaming method that reads every message and drops it."""
    import grpc

    from enginectl.weights.v1 import weight_update_service_pb2 as pb2

    def stream(requests: Any, context: Any) -> bytes:
        n = 0
        for message in requests:
            n += len(message.chunk.data)
        return n.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink",
        {
            "Stream": grpc.stream_unary_rpc_method_handler(
                stream, request_deserializer=pb2.UpdateWeightsFromTensorsRequest.FromString
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    emit("ready", port=port)
    sys.stdin.read()
    server.stop(0)


def bucketed(tensors: list[Any], bucket_bytes: int) -> list[Any]:
    """`tensors` as the collectives of a broadcast in buckets of `bucket_bytes` (the trainer
    client's layout, common/buckets.py): a packed bucket as one flat uint8 tensor."""
    import torch

    sizes = [t.numel() * t.element_size() for t in tensors]
    return [
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors[b.start : b.stop]])
        if b.packed
        else tensors[b.start]
        for b in buckets.cut(sizes, bucket_bytes)
    ]


def gloo_recv(port: int, file: str, reps: int, bucket_bytes: int) -> None:
    """Rank 1 of a raw gloo group with the `run` process: receive every tensor (or bucket)
    `reps` times into buffers allocated once, acknowledging each round."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        buffers = [torch.empty_like(f.get_tensor(k)) for k in f.keys()]  # safe_open is not a dict
    buffers = bucketed(buffers, bucket_bytes)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, datetime.timedelta(seconds=120))
    ack = torch.zeros(1)
    for _ in range(reps):
        for b in buffers:
            pg.broadcast(b, 0).wait()
        pg.broadcast(ack, 1).wait()


def raw_gloo(
    file: str, tensors: list[Any], reps: int, beside: Callable[[], object] | None = None, bucket_bytes: int = 0
) -> list[float]:
    """Seconds of each of `reps` raw broadcasts of `tensors` (in buckets of `bucket_bytes`;
    0: one per tensor) to a peer process; with `beside`, each rep also runs `beside` on a
    thread from its start, and lasts until both ended."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.weights.clients",
            "gloo-recv",
            "--port",
            str(store.port),
            "--file",
            file,
            "--reps",
            str(reps),
            "--bucket-bytes",
            str(bucket_bytes),
        ]
    )
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, datetime.timedelta(seconds=120))
        ack = torch.zeros(1)

        collectives = bucketed(tensors, bucket_bytes)

        def one_rep() -> None:
            for t in collectives:
                pg.broadcast(t, 0).wait()
            pg.broadcast(ack, 1).wait()

        return [together(one_rep, beside) for _ in range(reps)]
    finally:
        child.wait(60)


def together(call: Callable[[], object], beside: Callable[[], object] | None) -> float:
    """Seconds until `call` and `beside` (on a thread, started first) both ended."""
    thread = threading.Thread(target=beside) if beside is not None else None
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    call()
    if thread is not None:
        thread.join()
    return time.perf_counter() - t0


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def http_json(port: int, path: str, body: dict[str, Any]) -> Any:
    """POST `body` as JSON to the server's HTTP API; the decoded JSON answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def http_post(port: int, path: str, body: dict[str, Any] | None = None) -> float:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - t0


# -- the measurements -------------------------------------------------------------------------
def summary(times: list[float], nbytes: int = 0, results: Sequence[Any] = ()) -> dict[str, Any]:
    """Median and min wall time (and GB/s); for enginectl updates also the server's own view:
    `server_ms` (acceptance to done) and `rank_ms` (rank 0 receiving and loading)."""
    med = statistics.median(times)
    out: dict[str, Any] = {"n": len(times), "median_ms": round(med * 1e3, 3), "min_ms": round(min(times) * 1e3, 3)}
    if nbytes:
        out["gb_per_s"] = round(nbytes / med / 1e9, 3)
    if results:
        out["server_ms"] = round(statistics.median(r.duration for r in results) * 1e3, 3)
        out["rank_ms"] = round(statistics.median(r.ranks[0].duration for r in results) * 1e3, 3)
    return out


def run(target: str, http_port: int, vllm_http_port: int, model: Path, reps: int, pause_reps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from enginectl.client import TrainerClient
    from enginectl.client.trainer_tensors import named_tensors

    file = model / "model.safetensors"
    file.read_bytes()  # into the page cache
    named = named_tensors(load_file(str(file)))
    payload = sum(t.numel() * t.element_size() for _, t in named)
    results: dict[str, Any] = {"file_bytes": file.stat().st_size, "payload_bytes": payload, "num_tensors": len(named)}
    copy = floors.MemcpyFloor([t for _, t in named])
    body = {"method": "bench_reload_in_memory", "kwargs": {"path": str(file)}}
    http_json(http_port, "/collective_rpc", body)  # the worker reads the file once, and keeps it

    def reload() -> None:  # the in-memory reload, run beside a raw transport (bench/weights/floors.py)
        http_json(http_port, "/collective_rpc", body)

    with TrainerClient(target, timeout=600) as client:
        results["pause"], get_state = measure_pause(client, vllm_http_port, pause_reps)
        results["engine_round_trip_floor"] = floors.engine_round_trips(get_state)
        results["disk"] = measure_disk(client, http_port, model, payload, reps, copy)
        results["tensors"] = measure_tensors(client, named, payload, reps, copy, reload)
        results["gloo"] = measure_gloo(client, str(file), named, payload, reps, copy, reload)
        if "NCCL" in client.get_server_info().backends and _has_cuda():
            results["nccl"] = measure_nccl(client, named, payload, reps)
        results["ipc"] = measure_ipc(client, http_port, str(file), named, payload, reps)
        workers = client.get_server_info().num_workers
    rounds = measure_transfer(target, lambda path, body: http_json(http_port, path, body), named, workers, reps)
    results["transfer"] = {way: summary(times, payload) for way, times in rounds.items()}
    results["memcpy_floor"] = copy.result()
    return results


def measure_pause(client: Any, vllm_http_port: int, reps: int) -> tuple[dict[str, Any], list[float]]:
    """Pause + resume round trips, enginectl vs vLLM HTTP on the plain vLLM API server at
    `vllm_http_port`; and the GetGenerationState wall times sampled between them (two a rep) for
    the round-trip floor. Both servers are idle: nothing else runs on either during the reps."""
    idle = vllm_idle(vllm_http_port)
    if not idle["idle"]:
        raise RuntimeError(f"the vLLM API server is not idle before the pause reps: {idle}")
    ours, theirs, get_state = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        client.pause_generation("keep")
        client.resume_generation()
        ours.append(time.perf_counter() - t0)
        theirs.append(http_post(vllm_http_port, "/pause?mode=keep") + http_post(vllm_http_port, "/resume"))
        for _ in range(2):
            t0 = time.perf_counter()
            client.generation_state()
            get_state.append(time.perf_counter() - t0)
    return {"enginectl": summary(ours), "vllm_http": {**summary(theirs), "before": idle}}, get_state


def vllm_idle(port: int) -> dict[str, Any]:
    """Whether the vLLM API server is unpaused with no request running or waiting (`/is_paused`
    and its Prometheus gauges)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_paused", timeout=30) as response:
        paused = bool(json.loads(response.read())["is_paused"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    requests = 0.0
    for line in metrics.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            requests += float(line.rsplit(" ", 1)[1])
    return {"idle": not paused and requests == 0, "paused": paused, "requests": requests}


def measure_disk(
    client: Any, http_port: int, model: Path, payload: int, reps: int, copy: floors.MemcpyFloor
) -> dict[str, Any]:
    """enginectl's UpdateWeightsFromDisk vs vLLM's own reload_weights of the same directory;
    and the fingerprint every declaration takes, alone: a sampled VerifyWeights right after
    each reload (fresh kernels, as after an update's load; bench/weights/floors.py)."""
    ours, theirs, done, fingerprint = [], [], [], []
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}
    for i in range(reps):
        t0 = time.perf_counter()
        done.append(client.update_weights_from_disk(str(model), f"disk-{i}"))
        ours.append(time.perf_counter() - t0)
        theirs.append(http_post(http_port, "/collective_rpc", body))
        t0 = time.perf_counter()
        client.verify_weights()
        fingerprint.append(time.perf_counter() - t0)
        copy.sample()
    return {
        "enginectl": summary(ours, payload, done),
        "reload_weights": summary(theirs, payload),
        "fingerprint": summary(fingerprint),
    }


def measure_tensors(
    client: Any,
    named: list[tuple[str, Any]],
    payload: int,
    reps: int,
    copy: floors.MemcpyFloor,
    reload: Callable[[], None],
) -> dict[str, Any]:
    """enginectl's tensor stream end to end (incl. the load) vs the same messages into a gRPC
    sink; and that stream with the in-memory reload running beside it (the floor)."""
    import grpc

    from enginectl.client.trainer_tensors import chunks, tensor_spec
    from enginectl.weights.v1 import weight_update_service_pb2 as pb2

    header = pb2.UpdateWeightsFromTensorsRequest(
        header=pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named])
    )
    sink_proc = subprocess.Popen(
        [sys.executable, "-m", "bench.weights.clients", "sink"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink_proc.stdout is not None
        port = json.loads(sink_proc.stdout.readline())["port"]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        send = channel.stream_unary(
            SINK_METHOD, request_serializer=pb2.UpdateWeightsFromTensorsRequest.SerializeToString
        )
        ours, theirs, done, beside = [], [], [], []
        for i in range(reps):
            t0 = time.perf_counter()
            done.append(client.update_weights_from_tensors(named, f"tensors-{i}", chunk_bytes=CHUNK_BYTES))
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = int.from_bytes(send(iter([header, *chunks(named, CHUNK_BYTES)]), timeout=600), "little")
            theirs.append(time.perf_counter() - t0)
            assert got == payload, (got, payload)
            beside.append(together(lambda: send(iter([header, *chunks(named, CHUNK_BYTES)]), timeout=600), reload))
            copy.sample()
        channel.close()
    finally:
        assert sink_proc.stdin is not None
        sink_proc.stdin.close()
        sink_proc.wait(60)
    return {
        "enginectl": summary(ours, payload, done),
        "raw_grpc_stream": summary(theirs, payload),
        "raw_grpc_stream_beside_reload": summary(beside, payload),
    }


def measure_gloo(
    client: Any,
    file: str,
    named: list[tuple[str, Any]],
    payload: int,
    reps: int,
    copy: floors.MemcpyFloor,
    reload: Callable[[], None],
) -> dict[str, Any]:
    """enginectl's broadcast (this process is the trainer) vs a raw two-process gloo broadcast;
    and that broadcast, in the client's buckets, with the in-memory reload beside it (the floor)."""
    client.init_weights_update_group("bench", timeout=120)
    ours, done, per_tensor, per_tensor_done = [], [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        done.append(client.broadcast_weights(named, f"gloo-{i}", group_name="bench"))
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        per_tensor_done.append(client.broadcast_weights(named, f"gloo-1x-{i}", group_name="bench", bucket_bytes=0))
        per_tensor.append(time.perf_counter() - t0)
        copy.sample()
    client.destroy_weights_update_group("bench")
    theirs = raw_gloo(file, [t for _, t in named], reps)
    beside = raw_gloo(file, [t for _, t in named], reps, reload, DEFAULT_BUCKET_BYTES)
    return {
        "enginectl": summary(ours, payload, done),
        "enginectl_per_tensor": summary(per_tensor, payload, per_tensor_done),
        "raw_gloo": summary(theirs, payload),
        "raw_gloo_beside_reload": summary(beside, payload),
    }


def measure_nccl(client: Any, named: list[tuple[str, Any]], payload: int, reps: int) -> dict[str, Any]:
    """enginectl's NCCL broadcast (the same bucketed code as gloo, buffers on the GPUs), bucketed
    and per tensor; only where this process and the engine have CUDA."""
    client.init_weights_update_group("bench-nccl", backend="nccl", timeout=120)
    ours, done, per_tensor, per_tensor_done = [], [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        done.append(client.broadcast_weights(named, f"nccl-{i}", group_name="bench-nccl"))
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        per_tensor_done.append(client.broadcast_weights(named, f"nccl-1x-{i}", group_name="bench-nccl", bucket_bytes=0))
        per_tensor.append(time.perf_counter() - t0)
    client.destroy_weights_update_group("bench-nccl")
    return {
        "enginectl": summary(ours, payload, done),
        "enginectl_per_tensor": summary(per_tensor, payload, per_tensor_done),
    }


def measure_ipc(
    client: Any, http_port: int, file: str, named: list[tuple[str, Any]], payload: int, reps: int
) -> dict[str, Any]:
    """enginectl's same-host zero-copy update (handles to this process's tensors, end to end:
    pause, load, cache reset, fingerprint, resume) vs vLLM's reload_weights over the same
    tensors already in the worker's memory, timed inside the worker (bench/lib/worker_ext.py)."""
    body = {"method": "bench_reload_in_memory", "kwargs": {"path": file}}
    http_json(http_port, "/collective_rpc", body)  # the worker reads the file once, and keeps it
    ours, theirs, done = [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        done.append(client.update_weights_from_ipc(named, f"ipc-{i}"))
        ours.append(time.perf_counter() - t0)
        theirs.append(max(float(r) for r in http_json(http_port, "/collective_rpc", body)["results"]))
    return {"enginectl": summary(ours, payload, done), "reload_in_memory": summary(theirs, payload)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.weights.clients")
    parser.add_argument("mode", choices=("build", "run", "sink", "gloo-recv"))
    parser.add_argument("--quick", action="store_true", help="build: the smoke-run checkpoints")
    parser.add_argument("--target")
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--vllm-http-port", type=int, help="run: the plain vLLM API server (the pause baseline)")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pause-reps", type=int, default=20)
    parser.add_argument("--port", type=int)
    parser.add_argument("--file")
    parser.add_argument("--bucket-bytes", type=int, default=0)
    args = parser.parse_args()
    try:
        if args.mode == "build":
            built = {c.key: str(checkpoints.build(c)) for c in checkpoints.checkpoints(args.quick)}
            emit("result", models=built)
        elif args.mode == "run":
            emit(
                "result",
                **run(args.target, args.http_port, args.vllm_http_port, args.model, args.reps, args.pause_reps),
            )
        elif args.mode == "sink":
            sink()
        else:
            gloo_recv(args.port, args.file, args.reps, args.bucket_bytes)
    except Exception as exc:  # reported to the orchestrator, which raises it
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main()
