"""Weight loading, fingerprints and private broadcast groups inside vLLM's workers.

Runs INSIDE every vLLM worker process (vLLM's `worker_extension_cls`); the `enginectl serve`
process reaches these methods through `collective_rpc` on every EngineCore. Nothing here
imports gRPC: plans and results are plain dicts.

Loading always goes through the worker's own `reload_weights(weights_iterator=...)` (on the
CPU build a bare `model.load_weights` fails: linear layers were repacked after load). The
iterator handed to vLLM never raises: when the source fails (a broken sender, a deadline, an
abort from the server) it stops early and records why, so vLLM still finalises every layer
and the model stays usable; the server then knows whether any tensor was written
(`weights_modified`) and reports a partial update.

Data and control reach the worker over ZMQ from the server: a PULL socket per update carries
stream chunks (tensor stream) and `abort` frames (CancelOperation, timeout, broken stream);
progress goes back on a PUSH socket.
"""

from __future__ import annotations

import datetime
import queue
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

import enginectl.worker.engine_utilities  # noqa: F401  (attaches the EngineCore utility)
from enginectl.worker.fingerprints import FingerprintMixin, weight_access

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
PROGRESS_INTERVAL_S = 0.05
POLL_MS = 20


class Abort(Exception):
    """The update must stop: `cause` is a stable reason (UPDATE_CANCELLED, UPDATE_TIMEOUT, ...)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class _Group:
    name: str
    pg: Any
    rank: int
    world_size: int
    timeout: float  # gloo's (or NCCL's) own bound on one collective
    broken: str | None = None
    # Receive buffers by (name, dtype, shape), reused across updates: fresh pages are slow.
    buffers: dict[tuple[str, str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)


class _Channel:
    """The worker's end of one update's ZMQ data/control channel."""

    def __init__(self, plan: dict[str, Any], dp_rank: int) -> None:
        self._ctx = zmq.Context.instance()
        self.data = self._ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.connect(plan["data_endpoints"][dp_rank])
        self.progress_socket = self._ctx.socket(zmq.PUSH)
        self.progress_socket.setsockopt(zmq.LINGER, 0)
        self.progress_socket.setsockopt(zmq.SNDHWM, 4)
        self.progress_socket.connect(plan["progress_endpoint"])
        self.deadline = float(plan["deadline"])  # time.time() based
        # On the tensor stream, data frames are the payload: only recv() may read them.
        self._peek_aborts = plan["source"] != "tensors"
        self.dp_rank = dp_rank
        self._last_progress = 0.0
        self._latest = self._sent = (0, 0)  # (tensors, bytes) loaded; and as last reported

    def check(self) -> None:
        """Raise Abort if the server sent one or the deadline passed; never blocks."""
        if time.time() > self.deadline:
            raise Abort("UPDATE_TIMEOUT", "the update's timeout elapsed")
        while self._peek_aborts and self.data.poll(0):
            self._handle(self.data.recv_multipart(copy=False))

    def recv(self) -> list[Any]:
        """The next data message (stream chunk or end); raises Abort on abort/deadline."""
        while True:
            remaining = self.deadline - time.time()
            if remaining <= 0:
                raise Abort("UPDATE_TIMEOUT", "the update's timeout elapsed while receiving")
            self.flush()
            if self.data.poll(min(POLL_MS * 10, int(remaining * 1000) + 1)):
                frames = self.data.recv_multipart(copy=False)
                self._handle(frames)
                return frames

    @staticmethod
    def _handle(frames: list[Any]) -> None:
        if bytes(frames[0].buffer) == b"abort":
            cause, message = bytes(frames[1].buffer).decode(), bytes(frames[2].buffer).decode()
            raise Abort(cause, message)

    def progress(self, tensors: int, nbytes: int, *, force: bool = False) -> None:
        """Report what this worker has loaded: at most every PROGRESS_INTERVAL_S while loading;
        `flush` sends what is still unreported whenever the worker waits for data, so the
        Operation's progress never lags the weights by more than an interval and a poll."""
        self._latest = (tensors, nbytes)
        if force or time.monotonic() - self._last_progress >= PROGRESS_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self._latest == self._sent:
            return
        try:
            self.progress_socket.send(struct.pack("<iIQ", self.dp_rank, *self._latest), zmq.NOBLOCK)
        except zmq.Again:
            return  # the server is behind; the next progress or flush sends the latest
        self._sent = self._latest
        self._last_progress = time.monotonic()

    def close(self) -> None:
        self.data.close(0)
        self.progress_socket.close(0)


@dataclass(frozen=True)
class _ReceiveFailed:
    """The broadcast receive thread's failure, handed to the loading thread."""

    error: BaseException
    timed_out: bool


@dataclass
class _LoadState:
    yielded: int = 0
    loaded: int = 0
    nbytes: int = 0
    error: tuple[str, str] | None = None


class EnginectlWorkerExtension(FingerprintMixin):
    """Mixed into vLLM's worker class (`--worker-extension-cls`); see the module docstring."""

    # --- identity of this worker -------------------------------------------------------

    def _enginectl_dp_rank(self) -> int:
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)

    def _enginectl_global_rank(self) -> int:
        """This worker's index among all workers of all DP ranks."""
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return self._enginectl_dp_rank() * parallel.world_size + int(self.rank)  # type: ignore[attr-defined]

    def _enginectl_groups(self) -> dict[str, _Group]:
        groups = getattr(self, "_enginectl_group_table", None)
        if groups is None:
            groups = {}
            self._enginectl_group_table = groups
        return groups

    # --- loading -----------------------------------------------------------------------

    def enginectl_load(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Load the weights `plan` names; returns this worker's result (never raises)."""
        with weight_access(self, "load"):
            return self._enginectl_load(plan)

    def _enginectl_load(self, plan: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        dp_rank = self._enginectl_dp_rank()
        state = _LoadState()
        channel = _Channel(plan, dp_rank)
        try:
            source = plan["source"]
            if source == "disk":
                tensors = self._enginectl_disk_tensors(plan)
            elif source == "tensors":
                tensors = self._enginectl_stream_tensors(plan, channel)
            elif source == "distributed":
                tensors = self._enginectl_broadcast_tensors(plan, channel)
            else:
                raise ValueError(f"unknown source {source!r}")

            def guarded() -> Iterator[tuple[str, torch.Tensor]]:
                try:
                    for name, tensor in tensors:
                        channel.check()
                        if state.yielded == 0:
                            self.enginectl_weights_changing()
                        state.yielded += 1
                        yield name, tensor
                        state.loaded += 1
                        state.nbytes += tensor.numel() * tensor.element_size()
                        channel.progress(state.loaded, state.nbytes)
                except Abort as exc:
                    state.error = (exc.cause, str(exc))
                except Exception as exc:  # a broken sender, a truncated file, ...
                    cause = "STREAM_BROKEN" if source == "distributed" else "LOAD_FAILED"
                    state.error = (cause, f"{type(exc).__name__}: {exc}")

            try:
                self.reload_weights(weights_iterator=guarded())  # type: ignore[attr-defined]
            except Exception as exc:
                state.error = state.error or ("LOAD_FAILED", f"{type(exc).__name__}: {exc}")
                _finalize_after_failure(self)
        except Exception as exc:
            state.error = state.error or ("LOAD_FAILED", f"{type(exc).__name__}: {exc}")
        finally:
            channel.progress(state.loaded, state.nbytes, force=True)
            channel.close()
        return {
            "dp_rank": dp_rank,
            "worker_rank": int(self.rank),  # type: ignore[attr-defined]
            "tensors_loaded": state.loaded,
            "bytes_loaded": state.nbytes,
            "weights_modified": state.yielded > 0,
            "duration": time.monotonic() - started,
            "error": list(state.error) if state.error else None,
        }

    def _enginectl_disk_tensors(self, plan: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in plan["files"]:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    def _enginectl_stream_tensors(
        self, plan: dict[str, Any], channel: _Channel
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors from stream chunks, each yielded as soon as its last byte arrived."""
        specs = plan["tensors"]
        total = sum(_nbytes(spec) for spec in specs)
        buffer = _reusable_buffer(self, total)
        view = memoryview(buffer.numpy())
        index, start = 0, 0
        while index < len(specs):
            frames = channel.recv()  # a chunk (an abort raises: short streams end that way)
            (offset,) = struct.unpack("<Q", bytes(frames[1].buffer))
            data = frames[2].buffer
            view[offset:offset + len(data)] = data
            received = offset + len(data)
            while index < len(specs) and start + _nbytes(specs[index]) <= received:
                name, dtype, shape = specs[index]
                size = _nbytes(specs[index])
                tensor = buffer[start:start + size].view(DTYPES[dtype]).reshape(shape)
                start += size
                index += 1
                yield name, tensor

    def _enginectl_broadcast_tensors(
        self, plan: dict[str, Any], channel: _Channel
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors broadcast by the trainer (group rank 0), received on a thread so that
        receiving the next tensor overlaps loading this one."""
        group = self._enginectl_groups().get(plan["group"])
        if group is None:
            raise Abort("GROUP_NOT_FOUND", f"no update group {plan['group']!r} on this worker")
        if group.broken:
            raise Abort("GROUP_BROKEN", group.broken)
        received: queue.Queue[tuple[str, torch.Tensor] | _ReceiveFailed | None] = queue.Queue(maxsize=2)
        stop = threading.Event()

        def receive() -> None:
            waiting_since = time.monotonic()
            try:
                for name, dtype, shape in plan["tensors"]:
                    key = (name, dtype, tuple(shape))
                    tensor = group.buffers.get(key)
                    if tensor is None:
                        tensor = group.buffers[key] = torch.empty(shape, dtype=DTYPES[dtype])
                    waiting_since = time.monotonic()
                    group.pg.broadcast(tensor, 0).wait()
                    while not stop.is_set():
                        try:
                            received.put((name, tensor), timeout=POLL_MS / 1000)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                received.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
                group.broken = f"{type(exc).__name__}: {exc}"
                # gloo raises the same error type for its timeout and for a dead peer: a failure
                # after (nearly) the group's whole timeout of waiting is the timeout.
                waited = time.monotonic() - waiting_since
                received.put(_ReceiveFailed(exc, timed_out=waited >= 0.9 * group.timeout))

        thread = threading.Thread(target=receive, name=f"enginectl-recv-{group.name}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    channel.check()
                except Abort as exc:
                    if exc.cause == "UPDATE_TIMEOUT":  # still receiving: the broadcast is late
                        raise Abort("GROUP_TIMEOUT", f"the broadcast did not complete in time: {exc}") from None
                    raise
                try:
                    item = received.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    channel.flush()
                    continue
                if item is None:
                    return
                if isinstance(item, _ReceiveFailed):
                    late = item.timed_out or time.time() >= channel.deadline
                    raise Abort("GROUP_TIMEOUT" if late else "STREAM_BROKEN",
                                f"the broadcast failed: {type(item.error).__name__}: {item.error}")
                yield item
        finally:
            stop.set()
            if thread.is_alive():
                # Blocked in a receive: the group can not be trusted again; the server destroys it.
                group.broken = group.broken or "an update stopped while receiving through this group"

    # --- process groups ----------------------------------------------------------------

    def enginectl_init_group(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Join the private group `spec["name"]` (own TCPStore + PrefixStore); vLLM's own
        process groups are never touched. Raises on failure (the server reports it)."""
        groups = self._enginectl_groups()
        if spec["name"] in groups:
            raise RuntimeError(f"group {spec['name']!r} exists on this worker")
        rank = int(spec["rank_offset"]) + self._enginectl_global_rank()
        timeout = datetime.timedelta(seconds=float(spec["timeout"]))
        store = torch.distributed.TCPStore(
            spec["master_address"], int(spec["master_port"]), int(spec["world_size"]),
            is_master=False, timeout=timeout, wait_for_workers=False,
        )
        prefixed = torch.distributed.PrefixStore(f"enginectl/{spec['name']}", store)
        if spec["backend"] == "nccl":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg: Any = torch.distributed.ProcessGroupNCCL(prefixed, rank, int(spec["world_size"]), options)
        else:
            pg = torch.distributed.ProcessGroupGloo(prefixed, rank, int(spec["world_size"]), timeout)
        groups[spec["name"]] = _Group(spec["name"], pg, rank, int(spec["world_size"]), timeout.total_seconds())
        # A first barrier-like broadcast proves every member joined before we answer.
        probe = torch.zeros(1, dtype=torch.int64)
        pg.broadcast(probe, 0).wait()
        return {"dp_rank": self._enginectl_dp_rank(), "rank": rank}

    def enginectl_destroy_group(self, name: str) -> bool:
        group = self._enginectl_groups().pop(name, None)
        if group is None:
            return False
        group.buffers.clear()
        # Dropping the last reference closes gloo's connections (no collective needed).
        del group
        return True


def _nbytes(spec: list[Any]) -> int:
    name, dtype, shape = spec
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * DTYPES[dtype].itemsize


def _reusable_buffer(worker: Any, size: int) -> torch.Tensor:
    """A uint8 receive buffer of `size` bytes, reused across updates when it fits."""
    buffer = getattr(worker, "_enginectl_stream_buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.uint8)
        worker._enginectl_stream_buffer = buffer
    return buffer[:size]


def _finalize_after_failure(worker: Any) -> None:
    """vLLM's reload raised between its layerwise initialise and finalise: finalise anyway
    so every layer is back in kernel form (with whatever weights it holds)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
    except Exception:  # noqa: BLE001 - best effort; the update is reported failed already
        pass
