"""Child processes for tests/e2e/test_faults.py: clients the test kills, stalls or releases at a
known point.

Runs as `python tests/support/fault_procs.py MODE ARGS...`. Each mode prints one JSON line (flushed)
per point it reaches, so the test acts on a known point (a kill lands after that line):

- `stream TARGET FILE REQUEST_ID VERSION SEND_BYTES`: UpdateWeightsFromTensors of every
  tensor of the safetensors FILE, in file order: the header, then 100 kB chunks up to
  SEND_BYTES, then prints {"sent": bytes} and waits for a line on stdin. A line (or EOF)
  half-closes the stream early, as a client that gives up cleanly. However the call ends,
  prints {"code", "reason", "metadata", "message"} and exits 0.
- `broadcast TARGET FILE GROUP VERSION SEND_COUNT TIMEOUT`: the trainer of group GROUP (rank 0
  and host of its TCPStore), through TrainerClient: InitWeightsUpdateGroup, then
  UpdateWeightsFromDistributed of FILE's tensors with `timeout` TIMEOUT seconds, broadcasts
  the first SEND_COUNT tensors, prints {"operation": name, "sent": n}, and blocks on stdin
  until it is closed (then exits 0).
- `fleet-stage TARGETS FILE VERSION SEND_BYTES`: a fleet trainer that dies mid-stage: stages
  FILE's tensors on every target of the comma-separated TARGETS but the last (tensor streams,
  stage_only), then streams the first SEND_BYTES to the last one, prints
  {"staged": [targets], "sent": bytes}, and blocks on stdin (the test kills it there).
- `fpm TARGET`: StreamForwardPassMetrics of every sample, heartbeats included; prints
  {"progress": {...}} for a progress message and {"sequence", "kind"} per sample.

Imports torch only in `broadcast` (a trainer has it); the others start fast.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import grpc

CHUNK_BYTES = 100_000
CALL_TIMEOUT_S = 300.0


def emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def stream(target: str, file: str, request_id: str, version: str, send_bytes: int) -> None:
    from safetensors.numpy import load_file

    from enginectl.client.errors import from_rpc_error
    from enginectl.weights.v1 import weight_update_service_pb2 as pb2
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

    dtypes = {"float32": pb2.TENSOR_DTYPE_FLOAT32, "float16": pb2.TENSOR_DTYPE_FLOAT16}
    tensors = load_file(file)
    header = pb2.TensorStreamHeader(
        tensors=[
            pb2.TensorSpec(name=name, dtype=dtypes[str(t.dtype)], shape=list(t.shape)) for name, t in tensors.items()
        ],
        weight_version=version,
        request_id=request_id,
    )
    data = b"".join(t.tobytes() for t in tensors.values())[:send_bytes]

    def messages() -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
        yield pb2.UpdateWeightsFromTensorsRequest(header=header)
        for offset in range(0, len(data), CHUNK_BYTES):
            yield pb2.UpdateWeightsFromTensorsRequest(
                chunk=pb2.TensorStreamChunk(offset=offset, data=data[offset : offset + CHUNK_BYTES])
            )
        emit({"sent": len(data)})
        sys.stdin.readline()  # released (or EOF): half-close before the last byte

    token = os.environ.get("ENGINECTL_TOKEN")  # a server with a token (test_smg_gateway.py)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(target) as channel:
        stub = pb2_grpc.WeightUpdateServiceStub(channel)
        try:
            op = stub.UpdateWeightsFromTensors(messages(), timeout=CALL_TIMEOUT_S, metadata=metadata)
            emit({"code": "OK", "reason": "", "metadata": {}, "message": "", "operation": op.name})
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            emit(
                {"code": error.code.name, "reason": error.reason, "metadata": error.metadata, "message": error.message}
            )
    os._exit(0)  # grpc's request thread may still be blocked reading stdin


def broadcast(target: str, file: str, group: str, version: str, count: int, timeout: float) -> None:
    from safetensors.torch import load_file

    from enginectl.client import TrainerClient

    tensors = load_file(file)
    client = TrainerClient(target)
    client.init_weights_update_group(group, timeout=60.0)
    # One collective per tensor: exactly `count` tensors go (tests/support/trainer_proc.py breaks a
    # bucketed broadcast part way).
    started = client.start_broadcast(tensors, version, group_name=group, timeout=timeout, bucket_bytes=0)
    if count:
        started.send(count)
    emit({"operation": started.name, "sent": count})
    sys.stdin.read()
    os._exit(0)


def fleet_stage(targets: list[str], file: str, version: str, send_bytes: int) -> None:
    from safetensors.torch import load_file

    from enginectl.client import TrainerClient
    from enginectl.client.trainer_tensors import chunks, tensor_spec
    from enginectl.weights.v1 import weight_update_service_pb2 as pb2
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

    tensors = load_file(file)
    for target in targets[:-1]:
        with TrainerClient(target) as client:
            client.stage_weights_from_tensors(tensors, version)
    named = list(tensors.items())
    header = pb2.TensorStreamHeader(tensors=[tensor_spec(n, t) for n, t in named], stage_only=True)
    sent = 0

    def messages() -> Iterator[pb2.UpdateWeightsFromTensorsRequest]:
        nonlocal sent
        yield pb2.UpdateWeightsFromTensorsRequest(header=header)
        for message in chunks(named, CHUNK_BYTES):
            if sent + len(message.chunk.data) > send_bytes:
                break
            sent += len(message.chunk.data)
            yield message
        emit({"staged": targets[:-1], "sent": sent})
        sys.stdin.read()  # killed here

    with grpc.insecure_channel(targets[-1]) as channel:
        pb2_grpc.WeightUpdateServiceStub(channel).UpdateWeightsFromTensors(messages(), timeout=CALL_TIMEOUT_S)
    os._exit(0)


def fpm(target: str) -> None:
    from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
    from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc

    channel = grpc.insecure_channel(target)
    stub = svc_grpc.ForwardPassMetricsServiceStub(channel)
    for response in stub.StreamForwardPassMetrics(svc_pb2.StreamForwardPassMetricsRequest(include_heartbeats=True)):
        if response.HasField("progress"):
            p = response.progress
            emit({"progress": {"sequence": p.sequence, "head_sequence": p.head_sequence, "incarnation": p.incarnation}})
        for sample in response.batch.samples:
            emit({"sequence": sample.sequence, "kind": sample.kind})


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "stream":
        stream(args[0], args[1], args[2], args[3], int(args[4]))
    elif mode == "broadcast":
        broadcast(args[0], args[1], args[2], args[3], int(args[4]), float(args[5]))
    elif mode == "fleet-stage":
        fleet_stage(args[0].split(","), args[1], args[2], int(args[3]))
    elif mode == "fpm":
        fpm(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
