"""TransferMixin: the steps of vLLM's weight-transfer API, run for enginectl's Operation.

Runs inside every vLLM worker process, mixed into EnginectlWorkerExtension; the server reaches
`enginectl_transfer` through `collective_rpc` (contract/engine.py `WorkerRpc.TRANSFER`), one
step per call, on the worker's RPC thread, between forward passes (the thread that may touch
the weights: worker/weights/fingerprints.py). Each step calls the vLLM worker's own method
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`, `shutdown_weight_transfer_engine`), so whichever engine vLLM built
(`--weight-transfer-config`: enginectl's `gloo`, vLLM's `nccl`, `ipc`, ...) moves the bytes. A
step never raises: its answer says what failed. ABORT is enginectl's own: it ends a round the
server gave up on (the trainer went away, a deadline), which vLLM's API has no call for, so the
next round can start.

How long a step holds the RPC thread is the engine's: enginectl's `gloo` engine bounds every
receive by its group's timeout; the server sends each step with a timeout past the round's
deadline (docs/architecture.md, "Worker calls and their deadlines").
"""

from __future__ import annotations

import time
from typing import Any

from enginectl.contract.engine import TransferAnswer, TransferStep, wire
from enginectl.worker.weights.fingerprints import weight_access
from enginectl.worker.weights.ranks import dp_rank
from enginectl.worker.weights.staging import drop_staged, release_if_kept, staging_state
from enginectl.worker.weights.transfer.staging_target import StagingTarget


class TransferMixin:
    """The TRANSFER worker RPC (module docstring)."""

    def enginectl_transfer(self, step: str, payload: Any = None) -> Any:
        started = time.monotonic()
        error, invalid = "", False
        worker: Any = self
        try:
            with weight_access(self, "transfer"):
                _run(worker, TransferStep(step), payload)
        except ValueError as exc:  # vLLM's parse_init_info / parse_update_info: nothing done
            error, invalid = f"{type(exc).__name__}: {exc}", True
        except Exception as exc:  # noqa: BLE001 - answered as this worker's failure
            error = f"{type(exc).__name__}: {exc}"
        return wire(TransferAnswer(dp_rank(self), int(worker.rank), error, invalid, time.monotonic() - started))


def _run(worker: Any, step: TransferStep, payload: Any) -> None:
    target: StagingTarget | None = getattr(worker, TARGET, None)  # the open round stages
    if step == TransferStep.INIT:
        _let_go_for(worker, payload)  # a ValueError here: refused, nothing changed
        try:
            worker.init_weight_transfer_engine(payload)
        except ValueError as exc:  # past the parse: a failure, not a refusal (the old connection is gone)
            raise RuntimeError(str(exc)) from exc
    elif step == TransferStep.START:
        setattr(worker, TARGET, None)
        if payload:
            _stage_into_target(worker, str(payload))
        worker.start_weight_update()
    elif step == TransferStep.UPDATE:
        if target is None:
            worker.enginectl_weights_changing()  # a digest slice in flight is superseded
        worker.update_weights(payload)
    elif step == TransferStep.FINISH:
        if target is None:
            worker.enginectl_weights_changing()
        setattr(worker, TARGET, None)
        worker.finish_weight_update()  # vLLM points the engine back at the model
        if target is not None:
            target.complete()
    elif step == TransferStep.SHUTDOWN:
        worker.shutdown_weight_transfer_engine()
    else:  # ABORT
        setattr(worker, TARGET, None)
        _abort(worker)


TARGET = "_enginectl_transfer_target"  # the worker's StagingTarget while a staged round is open


def _let_go_for(worker: Any, init_info: Any) -> None:
    """Before an init: the trainer connection in place, if any, is shut down, once the new
    init info parsed (a ValueError here leaves it as it was). The server inits again only with
    no round open: a trainer that restarted takes over (server/weights/transfer.py), as vLLM's
    own init does on plain vLLM. The engine's shutdown is a no-op without a connection."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return  # init_weight_transfer_engine says why
    engine.parse_init_info(init_info)
    worker.shutdown_weight_transfer_engine()


def _stage_into_target(worker: Any, token: str) -> None:
    """A round that stages: the engine's target is a StagingTarget over the worker's staging
    buffer (worker/weights/transfer/staging_target.py), until vLLM's finish, or a failed batch,
    resets it. The set staged before is dropped (the server keeps one); a buffer the model
    kept a view of after a commit is let go of first."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return  # start_weight_update says so
    state = staging_state(worker)
    drop_staged(state)
    if state.committed:
        release_if_kept(worker, state)
    target = StagingTarget(state, token, dp_rank(worker), int(worker.rank))
    engine.set_weight_update_target(target, engine.model_config)
    setattr(worker, TARGET, target)


def _abort(worker: Any) -> None:
    """End the open round without finishing it: the engine drops what it received (enginectl's
    `gloo` engine never touched the model before its finish), or vLLM's layerwise reload is
    finalised over what arrived (a partial update, quarantined by the server)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return
    # vLLM's worker clears its flag itself when update_weights raised; the round may still
    # have opened the layerwise reload.
    worker._weight_update_active = False
    abort = getattr(engine, "abort_weight_update", None)
    if callable(abort):
        abort()
    else:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(engine.model, engine.model_config)
        except Exception:  # noqa: BLE001 - nothing was open
            pass
    engine.reset_weight_update_target()
