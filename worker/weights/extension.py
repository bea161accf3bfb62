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

Where the tensors come from is the reader of the plan's source (worker/weights/readers/: the
disk files, the tensor stream, the trainer's memory over IPC, a group's broadcasts, a staged
set), opened on this thread before loading and closed before the RPC answers: an IPC update's
mappings of the trainer's memory never outlive the load. The load itself never asks which
source it reads. Data and control reach the worker over ZMQ from the server
(worker/weights/channel.py): stream chunks and abort frames (CancelOperation, timeout, broken
stream) in, progress out.

Building the worker attaches enginectl's EngineCore utilities (worker/attach.py): on
single-worker engines the worker runs in the EngineCore process, which then has them even
under another scheduler. Importing this module changes nothing in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import enginectl
from enginectl.common import dtypes
from enginectl.common.host import host_identity
from enginectl.contract.census import WorkerCensus
from enginectl.contract.engine import Cause, LoadError, LoadPlan, LoadResult, WorkerRpc, read, wire
from enginectl.contract.engine_config import EngineConfig
from enginectl.contract.prepare import PreparePlan
from enginectl.worker.attach import attach
from enginectl.worker.weights.channel import Abort, Channel
from enginectl.worker.weights.checks import CheckMixin
from enginectl.worker.weights.fingerprints import FingerprintMixin, weight_access
from enginectl.worker.weights.groups import GroupsMixin
from enginectl.worker.weights.prepare import prepare
from enginectl.worker.weights.ranks import place
from enginectl.worker.weights.readers import Reader, open_reader
from enginectl.worker.weights.staging import StagingMixin
from enginectl.worker.weights.transfer.engine import register as register_transfer_engine
from enginectl.worker.weights.transfer.steps import TransferMixin
from enginectl.worker.weights.written import install as record_writes


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
        config = EngineConfig.load(getattr(kwargs.get("vllm_config"), "additional_config", None))
        if config.load_check == "full":
            record_writes()  # what every load writes, for the check after it (written.py)
        return super().__new__(cls)

    def enginectl_census(self) -> Any:
        """This worker in the start-up census (a WorkerCensus; server/census.py)."""
        host = host_identity()
        where = place(self)
        return wire(WorkerCensus(where.dp_rank, where.worker_rank, host.hostname, host.boot_id, enginectl.__version__))

    def enginectl_prepare(self, plan_wire: Any) -> Any:
        """Before an update writes anything: whether this worker can read every file the
        server planned it from, as planned (a Prepared; worker/weights/prepare.py). Reads
        headers only and touches no weight."""
        where = place(self)
        return wire(prepare(read(PreparePlan, plan_wire), where.dp_rank, where.worker_rank))

    def enginectl_load(self, plan_wire: Any) -> Any:
        """Load the weights a LoadPlan names; answers this worker's LoadResult (never raises)."""
        with weight_access(self, "load"):
            return wire(self._enginectl_load(read(LoadPlan, plan_wire)))

    def _enginectl_load(self, plan: LoadPlan) -> LoadResult:
        started = time.monotonic()
        where = place(self)
        state = _LoadState()
        channel = Channel(plan, where)
        reader: Reader | None = None
        try:
            # What must precede the first tensor (files listed, handles mapped, the group found)
            # is done here: a source that refuses leaves the weights untouched.
            reader = open_reader(self, plan, channel)
            tensors, broken_cause = reader.tensors(), reader.broken_cause

            # Sizes by name, taken here: a torch call per tensor costs several times more once
            # vLLM's reload runs this generator (docs/weights.md, "Threads and the weights").
            sizes = {spec.name: dtypes.nbytes(spec.dtype, spec.shape) for spec in plan.tensors}

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
                    state.error = LoadError(broken_cause, f"{type(exc).__name__}: {exc}")

            try:
                self.reload_weights(weights_iterator=guarded())  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - reported as this worker's failure
                state.error = state.error or LoadError(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
                _finalize_after_failure(self)
        except Abort as exc:  # the source refused before loading began (an IPC handle, a group)
            state.error = state.error or LoadError(exc.cause, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported as this worker's failure
            state.error = state.error or LoadError(Cause.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            if reader is not None:  # after vLLM's reload: no IPC mapping outlives the load
                reader.close()
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


# Every worker RPC of the contract is a method here (vLLM's collective_rpc calls it by name).
_missing = [rpc.value for rpc in WorkerRpc if not callable(getattr(EnginectlWorkerExtension, rpc.value, None))]
assert not _missing, f"worker RPCs without a method: {_missing}"


def _finalize_after_failure(worker: Any) -> None:
    """vLLM's reload raised between its layerwise initialise and finalise: finalise anyway
    so every layer is back in kernel form (with whatever weights it holds)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
    except Exception:  # noqa: BLE001 - best effort; the update is reported failed already
        pass
