"""The tensors of an IPC update (UpdateWeightsFromIpc): the trainer's own memory, mapped
into this worker without a copy, then unmapped.

Runs inside a vLLM worker, on its RPC thread, within one LOAD worker RPC
(extension.py `enginectl_load`): that thread maps every handle, hands the tensors to vLLM's
`reload_weights` through the guarded iterator every source shares, and drops the mappings
before the RPC answers. No other thread touches them. Nothing is unpickled: the handles are
the engine contract's `IpcHandle` fields, which the server checked (server/weights/sources/ipc.py).

- CPU: the storage is a POSIX shared-memory segment that torch made
  (`_share_filename_cpu_`); torch keeps a 64-byte header (its reference count) in front of
  the data. The segment is mapped copy-on-write (MAP_PRIVATE) straight from /dev/shm, so the
  engine can never change the trainer's memory, and never registered with the trainer's
  torch_shm_manager, which would keep the segment, and the manager, alive for as long as
  this worker lives instead of going away with the trainer's tensor.
- CUDA: torch's own `rebuild_cuda_tensor` opens the share meant for this worker (one per
  worker: each releases its share when unmapped); it runs only where CUDA is.

Every handle is mapped before the first tensor is handed to vLLM: a handle that can not be
mapped fails the load with IPC_HANDLE_UNAVAILABLE while the weights are still untouched.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat

import torch

from enginectl.contract.engine import SHM_SEGMENT_PATTERN, Cause, CudaShare, IpcHandle, LoadPlan, TensorSpec
from enginectl.worker.weights.channel import Abort

SHM_DIR = "/dev/shm"
# torch's RefcountedMapAllocator keeps the segment's reference count in front of the data,
# padded to its alignment (tests/unit/test_weights_ipc.py checks it against the torch in use).
SHM_HEADER_BYTES = 64
MADV_POPULATE_READ = 22  # Linux >= 5.14; Python's mmap module does not name it
SEGMENT = re.compile(SHM_SEGMENT_PATTERN)


class IpcTensors:
    """The tensors of one IPC update on this worker, every handle already mapped."""

    def __init__(self, plan: LoadPlan, worker_index: int) -> None:
        """Map every handle of `plan` (Abort IPC_HANDLE_UNAVAILABLE at the first that fails,
        after unmapping the others); `worker_index` picks this worker's CUDA shares."""
        self._maps: dict[str, mmap.mmap] = {}  # by segment name: one mapping per storage
        self._storages: dict[str, torch.UntypedStorage] = {}
        self.pairs: list[tuple[str, torch.Tensor]] = []
        if len(plan.handles) != len(plan.tensors):
            raise Abort(Cause.IPC_HANDLE_UNAVAILABLE, f"{len(plan.handles)} handles for {len(plan.tensors)} tensors")
        # Tensors of one storage name one segment: map it once, as far as any of them needs.
        self._sizes: dict[str, int] = {}
        for handle in plan.handles:
            self._sizes[handle.segment] = max(self._sizes.get(handle.segment, 0), handle.storage_nbytes)
        try:
            for spec, handle in zip(plan.tensors, plan.handles, strict=True):
                self.pairs.append((spec.name, self._tensor(spec, handle, worker_index)))
        except Abort:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - torch or the OS refused a handle
            self.close()
            raise Abort(Cause.IPC_HANDLE_UNAVAILABLE, f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Drop every tensor and mapping. A mapping something else still holds (vLLM kept a
        tensor) stays until that reference goes: it is never unmapped under a live tensor."""
        self.pairs.clear()
        self._storages.clear()
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:
                pass
        self._maps.clear()

    def _tensor(self, spec: TensorSpec, handle: IpcHandle, worker_index: int) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype)
        if handle.cuda:
            if not 0 <= worker_index < len(handle.cuda):
                raise Abort(
                    Cause.IPC_HANDLE_UNAVAILABLE,
                    f"{spec.name}: {len(handle.cuda)} CUDA shares, none for worker {worker_index}",
                )
            return _cuda_tensor(spec, dtype, handle, handle.cuda[worker_index])
        if handle.storage_nbytes == 0:  # an empty tensor: nothing to map
            return torch.empty(spec.shape, dtype=dtype)
        storage = self._storages.get(handle.segment)
        if storage is None:
            nbytes = self._sizes[handle.segment]
            mapping = self._maps[handle.segment] = _map(spec.name, handle.segment, nbytes)
            data = torch.frombuffer(mapping, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=nbytes)
            storage = self._storages[handle.segment] = data.untyped_storage()
        # Out-of-bounds geometry was refused by the server; torch checks it again here.
        return torch.empty(0, dtype=dtype).set_(storage, handle.storage_offset, spec.shape, handle.stride)


def _map(name: str, segment: str, nbytes: int) -> mmap.mmap:
    """The header and first `nbytes` data bytes of `segment`, copy-on-write; Abort if the
    segment is not there or holds less (mapping past its end would fault on access)."""
    if not SEGMENT.fullmatch(segment):
        raise Abort(Cause.IPC_HANDLE_UNAVAILABLE, f"{name}: {segment!r} is not a torch segment name")
    try:
        fd = os.open(os.path.join(SHM_DIR, segment.lstrip("/")), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise Abort(
            Cause.IPC_HANDLE_UNAVAILABLE,
            f"{name}: no shared-memory segment {segment} here: the trainer freed the tensor, or it "
            "runs on another host or with another /dev/shm (a container)",
        ) from None
    try:
        info = os.fstat(fd)
        needed = SHM_HEADER_BYTES + nbytes
        if not stat.S_ISREG(info.st_mode) or info.st_size < needed:
            raise Abort(
                Cause.IPC_HANDLE_UNAVAILABLE,
                f"{name}: segment {segment} holds {max(info.st_size - SHM_HEADER_BYTES, 0)} bytes "
                f"of data; its handle says {nbytes}",
            )
        mapping = mmap.mmap(fd, needed, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # Map every page now, read-only, in one call, instead of one fault per page as vLLM reads
    # them (3% of an IPC load here; no copy: a private page is copied only when written). A
    # kernel before 5.14 refuses the advice; the pages then fault in as they are read.
    with contextlib.suppress(OSError):
        mapping.madvise(MADV_POPULATE_READ)
    return mapping


def _cuda_tensor(spec: TensorSpec, dtype: torch.dtype, handle: IpcHandle, share: CudaShare) -> torch.Tensor:
    """The tensor as torch.multiprocessing rebuilds a CUDA tensor it received
    (torch/multiprocessing/reductions.py `rebuild_cuda_tensor`, with the values of
    `_share_cuda_()`): the storage is cached per (memory handle, offset), so another tensor
    of the same storage maps nothing new and releases its share at once; the storage
    releases this worker's share when the last tensor on it goes."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensor: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(spec.shape),
        handle.stride,
        handle.storage_offset,
        torch.storage.TypedStorage,
        dtype,
        share.device,
        share.memory_handle,
        share.storage_nbytes,
        share.storage_offset_bytes,
        False,  # requires_grad
        share.ref_counter_handle,
        share.ref_counter_offset,
        share.event_handle,
        share.event_sync_required,
    )
    return tensor
