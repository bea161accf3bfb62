"""EnginectlWorkerExtension: weight loading, fingerprints and update groups inside vLLM's workers.

Runs INSIDE every vLLM worker process (vLLM's `worker_extension_cls`); the `enginectl serve`
process reaches these methods through `collective_rpc` on every EngineCore, by the names of
the engine contract (contract/engine.py `WorkerRpc`), with its structs as plain builtins.
Nothing here imports gRPC. Every method runs on the worker's RPC thread, which also runs the
forward pass, one at a time (worker/weights/fingerprints.py, "who may touch the weights").

Loading always goes through the worker's own `reload_weights(weights_iterator=...)` (on the
CPU build a bare `model.load_weights` fails: linear layers were repacked after load). The
iterator handed to vLLM never raises: when the source fails (a broken sender, a deadline, an
abort from the server) it stops early and records why, so vLLM still finalises every layer
and the model stays usable; the server then knows whether any tensor was written
(`weights_modified`) and reports a partial update.

Data and control reach the worker over ZMQ from the server (worker/weights/channel.py):
stream chunks and abort frames (CancelOperation, timeout, broken stream) in, progress out.
An IPC update's tensors are the trainer's memory, mapped on this thread before loading and
unmapped before the RPC answers (worker/weights/ipc.py).

Building the worker attaches enginectl's EngineCore utilities (worker/attach.py): on
single-worker engines the worker runs in the EngineCore process, which then has them even
under another scheduler. Importing this module changes nothing in vLLM.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from enginectl.common import dtypes
from enginectl.common.safetensors_header import parse_header
from enginectl.contract.engine import Cause, LoadError, LoadPlan, LoadResult, Source, TensorSpec, WorkerRpc, read, wire
from enginectl.worker.attach import attach
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.checks import CheckMixin
from enginectl.worker.weights.fingerprints import FingerprintMixin, weight_access
from enginectl.worker.weights.groups import GroupsMixin, aligned, typed_view
from enginectl.worker.weights.ipc import IpcTensors
from enginectl.worker.weights.ranks import place
from enginectl.worker.weights.staging import StagingMixin
from enginectl.worker.weights.transfer_engine import register as register_transfer_engine
from enginectl.worker.weights.transfer_steps import TransferMixin


@dataclass
class _LoadState:
    yielded: int = 0
    loaded: int = 0
    nbytes: int = 0
    error: LoadError | None = None


class EnginectlWorkerExtension(FingerprintMixin, CheckMixin, GroupsMixin, StagingMixin, TransferMixin):
    """Mixed into vLLM's worker class (`--worker-extension-cls`); see the module docstring."""

    def __new__(cls, *args: Any, **kwargs: Any) -> EnginectlWorkerExtension:
        # The extension's setup, when vLLM builds the worker (before any RPC, in the worker's
        # process): vLLM's WorkerBase.__init__ calls no super().__init__, so a mixin's
        # __init__ never runs, and every other method vLLM calls at init is the worker's own.
        attach()
        register_transfer_engine()  # vLLM's worker builds its transfer engine in load_model
        return super().__new__(cls)

    def enginectl_load(self, plan_wire: Any) -> Any:
        """Load the weights a LoadPlan names; answers this worker's LoadResult (never raises)."""
        with weight_access(self, "load"):
            return wire(self._enginectl_load(read(LoadPlan, plan_wire)))

    def _enginectl_load(self, plan: LoadPlan) -> LoadResult:
        started = time.monotonic()
        where = place(self)
        state = _LoadState()
        channel = Channel(plan, where)
        mapped: IpcTensors | None = None
        try:
            if plan.source == Source.DISK:
                # Every file mapped and viewed before vLLM sees a tensor: a file that no longer
                # fits its header fails the load with the weights untouched.
                tensors = _handed_over(list(disk_tensors(plan)))
            elif plan.source == Source.STAGED:  # a commit: from memory staged earlier
                tensors = self._enginectl_staged_tensors(plan)
            elif plan.source == Source.TENSORS:
                tensors = self._enginectl_stream_tensors(plan, channel)
            elif plan.source == Source.IPC:
                # Every handle mapped before vLLM sees a tensor: a bad one changes nothing.
                mapped = IpcTensors(plan, where.index)
                tensors = iter(mapped.pairs)
            else:
                tensors = self._enginectl_broadcast_tensors(plan, channel)

            # Sizes by name, taken here: a torch call per tensor costs several times more once
            # vLLM's reload runs this generator (docs/weights.md, "Threads and the weights").
            sizes = {spec.name: _nbytes(spec) for spec in plan.tensors}

            def guarded() -> Iterator[tuple[str, torch.Tensor]]:
                try:
                    for name, tensor in tensors:
                        channel.check()
                        if state.yielded == 0:
                            self.enginectl_weights_changing()
                        state.yielded += 1
                        yield name, tensor
                        state.loaded += 1
                        size = sizes.get(name)
                        state.nbytes += tensor.nbytes if size is None else size
                        channel.progress(state.loaded, state.nbytes)
                except Abort as exc:
                    state.error = LoadError(exc.cause, str(exc))
                except Exception as exc:  # noqa: BLE001 - a broken sender, a truncated file, ...
                    cause = Cause.STREAM_BROKEN if plan.source == Source.DISTRIBUTED else Cause.LOAD_FAILED
                    state.error = LoadError(cause, f"{type(exc).__name__}: {exc}")

            try:
                self.reload_weights(weights_iterator=guarded())  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - reported as this worker's failure
                state.error = state.error or LoadError(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
                _finalize_after_failure(self)
            if plan.source == Source.STAGED:
                self._enginectl_after_commit()
        except Abort as exc:  # the source refused before loading began (an IPC handle)
            state.error = state.error or LoadError(exc.cause, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported as this worker's failure
            state.error = state.error or LoadError(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            if mapped is not None:  # the trainer owns the memory: no mapping outlives the load
                mapped.close()
            channel.progress(state.loaded, state.nbytes, force=True)
            channel.close()
        return LoadResult(
            dp_rank=where.dp_rank,
            worker_rank=where.worker_rank,
            tensors_loaded=state.loaded,
            bytes_loaded=state.nbytes,
            weights_modified=state.yielded > 0,
            duration=time.monotonic() - started,
            error=state.error,
        )

    def _enginectl_stream_tensors(self, plan: LoadPlan, channel: Channel) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors from stream chunks, each yielded as soon as its last byte arrived. Every
        view of the reused receive buffer is made here, before vLLM's reload runs (inside it
        each torch call costs several times more); a tensor that a 1-byte tensor of odd size
        left unaligned is copied once it arrived instead (None until then)."""
        specs = plan.tensors
        buffer = _reusable_buffer(self, sum(_nbytes(spec) for spec in specs))
        views: list[torch.Tensor | None] = []
        ends: list[int] = []
        start = 0
        for spec in specs:
            views.append(typed_view(buffer, start, spec.dtype, spec.shape) if aligned(start, spec.dtype) else None)
            start += _nbytes(spec)
            ends.append(start)
        return _streamed(specs, buffer, views, ends, channel)


# Every worker RPC of the contract is a method here (vLLM's collective_rpc calls it by name).
_missing = [rpc.value for rpc in WorkerRpc if not callable(getattr(EnginectlWorkerExtension, rpc.value, None))]
assert not _missing, f"worker RPCs without a method: {_missing}"


def disk_tensors(plan: LoadPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a disk update's files, in file order."""
    for file in plan.files:
        yield from mapped_safetensors(file)


def mapped_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file, in the order of their bytes: views of the file
    mapped copy-on-write, so the load copies every byte once, from the page cache into the
    parameters (docs/weights.md, "disk"). The server checked the header before planning the
    update; a file changed since raises at the tensor that no longer fits, and since a load
    lists every file's tensors before vLLM sees one, the load fails (LOAD_FAILED) with the
    weights untouched."""
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    (header_len,) = struct.unpack_from("<Q", mapping, 0)
    start = 8 + header_len
    name = os.path.basename(path)
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping while a view lives
    for entry in parse_header(mapping[8:start], name):
        if start + entry.end > data.numel():
            raise ValueError(f"{name}: tensor {entry.name!r} does not fit the file")
        yield entry.name, typed_view(data, start + entry.begin, entry.dtype, entry.shape)


def _streamed(
    specs: tuple[TensorSpec, ...],
    buffer: torch.Tensor,
    views: list[torch.Tensor | None],
    ends: list[int],
    channel: Channel,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `specs` (`views` of `buffer`, ending at `ends`) as the chunks fill it."""
    received_view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    index = 0
    while index < len(specs):
        chunk = channel.recv()  # an abort raises: short streams end that way
        received_view[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        received = chunk.offset + len(chunk.data)
        while index < len(specs) and ends[index] <= received:
            spec, tensor = specs[index], views[index]
            if tensor is None:
                tensor = typed_view(buffer, ends[index] - _nbytes(spec), spec.dtype, spec.shape)
            index += 1
            yield spec.name, tensor


def _handed_over(pairs: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` in order, each let go of once handed on: the list does not keep a tensor (and
    its file mapping) alive after vLLM loaded it."""
    pairs.reverse()
    while pairs:
        yield pairs.pop()


def _nbytes(spec: TensorSpec) -> int:
    return dtypes.nbytes(spec.dtype, spec.shape)


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
