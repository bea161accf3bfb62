"""Fingerprints of the weights a vLLM worker holds, and the rule of who may touch them.

Runs INSIDE every vLLM worker process, mixed into the worker by `EnginectlWorkerExtension`
(worker/weights/extension.py); the `enginectl serve` process reaches these methods through
`collective_rpc` on every EngineCore (server/weights/version/fingerprints.py drives them). Their names
and answers are the engine contract's (contract/engine.py: WorkerRpc, WorkerDigest,
DigestSlice).

Who may touch the weights, and when (docs/weights.md "Threads and the weights"):
- The model's parameters and kernels (including the CPU build's packed linear kernels) are
  read, written or run by enginectl only inside a worker RPC, on the thread vLLM runs worker
  RPCs on. vLLM runs those RPCs one at a time on that thread, `execute_model` (the forward
  pass) among them, so an enginectl RPC never overlaps a forward pass.
- No enginectl thread touches them: background threads only move bytes into receive buffers
  that the RPC thread then hands to `reload_weights`.
- Work that is long (the full digest of every byte) is cut into slices of bounded size; the
  server sends one slice per EngineCore round trip, and the EngineCore handles utility calls
  between steps, so a slice costs a step at most `SLICE_BYTES` of CRC or `SLICE_SECONDS`,
  plus one packed layer's probe. A declaration's baseline reuses the probes its sampled digest took.
`weight_access` enforces the first two rules: every entry point that touches weights runs
inside it, and it refuses a second thread or an overlapping entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from enginectl.contract.engine import DigestJob, DigestSlice, WorkerDigest, wire
from enginectl.worker.weights.ranks import dp_rank

SAMPLE_ELEMENTS = 256  # per tensor, in the default (sampled) fingerprint
# Of the full digest per round trip: a few milliseconds of CRC32, so a slice never holds the
# engine's RPC thread long (bench/README.md, "Measurements behind the constants").
SLICE_BYTES = 32 << 20
SLICE_SECONDS = 0.008  # a slice also stops after this long, whatever its byte count


class WeightAccessError(RuntimeError):
    """Weights touched from a thread or at a time the rule above forbids (a bug)."""


class _WeightAccess:
    """The one guard of the rule: one owner thread, no overlapping entries."""

    def __init__(self) -> None:
        self._owner: int | None = None
        self._busy = False

    @contextlib.contextmanager
    def enter(self, what: str) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me  # the first RPC names vLLM's worker RPC thread
        if me != self._owner:
            raise WeightAccessError(
                f"{what}: weights touched from thread {threading.current_thread().name}, not the worker's RPC thread"
            )
        if self._busy:
            raise WeightAccessError(f"{what}: overlaps another access to the weights")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False


def weight_access(worker: Any, what: str) -> contextlib.AbstractContextManager[None]:
    """Enter the worker's weight guard (see the module docstring)."""
    access = getattr(worker, "_enginectl_weight_access", None)
    if access is None:
        access = worker._enginectl_weight_access = _WeightAccess()
    return access.enter(what)


class _FullDigest:
    """The full digest of one set of weights, taken a slice at a time: CRC32 of every tensor's
    bytes, then the probe of every packed layer (`_probe_output`), each slice bounded in bytes
    and time.

    Byte-for-byte the same as hashing every tensor at once: CRC32 runs on across slices. A
    declaration's baseline is given the probe outputs its sampled digest just took of the same
    weights (the same layers, inputs and kernels), and folds them in instead of a second pass
    over every packed weight; a verification probes the weights as they are now."""

    def __init__(self, model: Any, sampled: _Sampled | None = None) -> None:
        self._tensors = sampled.tensors if sampled else _hashable_tensors(model)
        self.layers = sampled.layers if sampled else list(packed_linears(model))
        self._probes = sampled.probes if sampled else None
        self._digest = hashlib.blake2b(digest_size=16)
        self._index = 0
        self._offset = 0
        self._crc = 0
        self._probed = 0
        self.result: str | None = None

    def advance(self, budget_bytes: int, budget_seconds: float) -> bool:
        """Hash up to `budget_bytes` (or `budget_seconds`) more; True once complete."""
        if self.result is not None:
            return True
        stop_at = time.monotonic() + budget_seconds
        budget = budget_bytes
        while self._index < len(self._tensors):
            name, tensor = self._tensors[self._index]
            data = tensor_bytes(tensor)
            if self._offset == 0:
                self._digest.update(_header(name, tensor))
            end = min(len(data), self._offset + max(budget, 0))
            self._crc = zlib.crc32(data[self._offset : end], self._crc)
            budget -= end - self._offset
            self._offset = end
            if self._offset < len(data):
                return False  # this slice's budget is spent inside the tensor
            self._digest.update(self._crc.to_bytes(4, "little"))
            self._index, self._offset, self._crc = self._index + 1, 0, 0
            if budget <= 0 or time.monotonic() >= stop_at:
                break
        if self._index < len(self._tensors):
            return False
        if self._probes is not None:
            for name, output in self._probes:
                _fold_probe(self._digest, name, output)
            self._probed = len(self.layers)
        with torch.inference_mode():
            while self._probed < len(self.layers):
                if time.monotonic() >= stop_at:
                    return False  # the probes go on in the next slice
                _fold_probe(self._digest, *_probe_output(*self.layers[self._probed]))
                self._probed += 1
        self.result = self._digest.hexdigest()
        return True


@dataclass
class _Baseline:
    """The full digest recorded for the declaration `token` (done, or being taken)."""

    token: str
    epoch: int
    sampled: str
    job: _FullDigest


@dataclass
class _FingerprintState:
    epoch: int = 0  # +1 whenever enginectl starts writing weights
    baseline: _Baseline | None = None
    verify: dict[str, _FullDigest] = field(default_factory=dict)


class FingerprintMixin:
    """Worker RPCs that fingerprint the weights (mixed into EnginectlWorkerExtension)."""

    def _enginectl_fingerprints(self) -> _FingerprintState:
        state = getattr(self, "_enginectl_fingerprint_state", None)
        if state is None:
            state = self._enginectl_fingerprint_state = _FingerprintState()
        return state

    def _enginectl_worker_ids(self) -> tuple[int, int]:
        """(dp_rank, worker_rank) of this worker."""
        return dp_rank(self), int(self.rank)  # type: ignore[attr-defined]

    def enginectl_weights_changing(self) -> None:
        """Called (under the guard) when enginectl starts writing weights: baselines of the old
        weights no longer describe what is loaded."""
        state = self._enginectl_fingerprints()
        state.epoch += 1
        state.verify.clear()

    def enginectl_fingerprint(self) -> Any:
        """The sampled digest of the weights in memory now (milliseconds). Full digests are
        taken in slices (`enginectl_full_digest`). Names both methods."""
        with weight_access(self, "fingerprint"):
            sampled = _sampled_digest(self.model_runner.get_model())  # type: ignore[attr-defined]
        return self._enginectl_digest_answer(sampled.digest, len(sampled.probes))

    def enginectl_declare_fingerprint(self, token: str) -> Any:
        """At a declaration: the sampled digest now (milliseconds), and a full digest recorded
        under `token` for VerifyWeights(full). The full one is taken in slices afterwards
        (`enginectl_full_digest`), unless the weights are the ones the last complete baseline
        hashed (no enginectl write since and the same sampled digest): then it is reused."""
        with weight_access(self, "declare fingerprint"):
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            sampled = _sampled_digest(model)
            digest = sampled.digest
            state = self._enginectl_fingerprints()
            last = state.baseline
            if (
                last is not None
                and last.job.result is not None
                and last.epoch == state.epoch
                and last.sampled == digest
            ):
                state.baseline = _Baseline(token, state.epoch, digest, last.job)
            else:
                state.baseline = _Baseline(token, state.epoch, digest, _FullDigest(model, sampled))
        return self._enginectl_digest_answer(digest, len(sampled.probes))

    def enginectl_full_digest(self, job: str, token: str, budget_bytes: int = SLICE_BYTES) -> Any:
        """One slice of a full digest (a DigestSlice). `job` BASELINE: the digest of the
        declaration `token` (superseded once another declaration replaced it, or the weights
        changed); VERIFY: the weights now, a job named by `token` started on its first slice."""
        kind = DigestJob(job)
        dp_rank, worker_rank = self._enginectl_worker_ids()
        with weight_access(self, "full digest"):
            state = self._enginectl_fingerprints()
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            if kind == DigestJob.BASELINE:
                baseline = state.baseline
                if baseline is None or baseline.token != token or baseline.epoch != state.epoch:
                    return wire(DigestSlice(dp_rank, worker_rank, done=True, superseded=True))
                digest_job = baseline.job
            else:
                digest_job = state.verify.setdefault(token, _FullDigest(model))
                while len(state.verify) > 4:  # abandoned jobs (a caller that went away)
                    state.verify.pop(next(iter(state.verify)))
            if not digest_job.advance(int(budget_bytes), SLICE_SECONDS):
                return wire(DigestSlice(dp_rank, worker_rank, done=False))
            if kind == DigestJob.VERIFY:
                state.verify.pop(token, None)
            return wire(
                DigestSlice(
                    dp_rank,
                    worker_rank,
                    done=True,
                    digest=str(digest_job.result),
                    method=_methods(len(digest_job.layers))[1],
                )
            )

    def _enginectl_digest_answer(self, digest: str, probes: int) -> Any:
        """A sampled digest (a WorkerDigest), naming both methods (GetServerInfo reports them)."""
        sampled_method, full_method = _methods(probes)
        dp_rank, worker_rank = self._enginectl_worker_ids()
        return wire(WorkerDigest(dp_rank, worker_rank, digest, sampled_method, sampled_method, full_method))


def _methods(probes: int) -> tuple[str, str]:
    suffix = "+gemv-probe" if probes else ""
    return f"sampled{SAMPLE_ELEMENTS}-blake2b{suffix}", f"full-crc32{suffix}"


def _hashable_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, tensor)
        for name, tensor in sorted(model.state_dict(keep_vars=False).items())
        if tensor.numel() > 0 and not tensor.is_meta
    ]


def _header(name: str, tensor: torch.Tensor) -> bytes:
    return f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, as they lie in memory (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class _Sampled:
    """A sampled digest, and what it read: the tensors and packed layers it listed and the
    probe outputs it folded in (a declaration's full baseline starts from them)."""

    digest: str
    tensors: list[tuple[str, torch.Tensor]]
    layers: list[tuple[str, Any, int]]
    probes: list[tuple[str, bytes]]


def _sampled_digest(model: Any) -> _Sampled:
    """Every parameter at SAMPLE_ELEMENTS evenly spaced elements, plus the probes."""
    digest = hashlib.blake2b(digest_size=16)
    tensors = _hashable_tensors(model)
    layers = list(packed_linears(model))
    with torch.inference_mode():
        for name, tensor in tensors:
            digest.update(_header(name, tensor))
            flat = tensor.detach().reshape(-1)
            if flat.numel() > SAMPLE_ELEMENTS:
                flat = flat[_sample_indices(flat.numel())]
            digest.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
        probes = [_probe_output(*layer) for layer in layers]
    for name, output in probes:
        _fold_probe(digest, name, output)
    return _Sampled(digest.hexdigest(), tensors, layers, probes)


@functools.lru_cache(maxsize=4096)
def _sample_indices(numel: int) -> torch.Tensor:
    """SAMPLE_ELEMENTS evenly spaced indices into `numel` elements (kept: a model has few sizes)."""
    return torch.linspace(0, numel - 1, SAMPLE_ELEMENTS).long()


@functools.lru_cache(maxsize=4096)
def probe_input(name: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed input of the probe of layer `name`, seeded by its name (kept: it never changes)."""
    generator = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    return torch.randn(1, in_features, generator=generator).to(dtype)


def packed_linears(model: Any) -> Iterator[tuple[str, Any, int]]:
    """Linear layers whose weight vLLM's CPU build moved into an opaque kernel (the weight
    tensor is left empty): (name, module, in_features)."""
    for name, module in sorted(model.named_modules()):
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if linear is None or weight is None or weight.numel() > 0:
            continue  # no kernel, or the weight itself is hashed
        in_features = int(getattr(module, "input_size_per_partition", 0) or getattr(module, "input_size", 0))
        if in_features > 0:
            yield name, module, in_features


def _probe_output(name: str, module: Any, in_features: int) -> tuple[str, bytes]:
    """The packed layer's output for a fixed input (seeded by its name): the kernel's weights
    are not readable, its behaviour is. The kernel is looked up now, so a probe sliced apart
    from the listing of the layers still sees the layer as it is. Call under inference_mode."""
    weight = module.weight
    probe = probe_input(name, in_features, weight.dtype)
    return name, module.cpu_linear(probe, weight, None).float().contiguous().view(torch.uint8).numpy().tobytes()


def _fold_probe(digest: Any, name: str, output: bytes) -> None:
    digest.update(name.encode())
    digest.update(output)
