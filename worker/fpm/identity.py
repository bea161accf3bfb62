"""WorkerIdentity: the one place a rank's worker id and identity generation live.

Runs inside each EngineCore process. Both the step-sample path (engine thread) and the
heartbeat path (publisher thread) read `current`, and the EngineCore utilities (engine
thread) change it, so a sample can never carry an identity other than the one the rank
held when it made the sample. Pure: no vLLM, no ZMQ.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from enginectl.common.labels import MAX_WORKER_ID_BYTES, label_problem


@dataclass(frozen=True)
class IdentityState:
    """What a rank stamps on its samples: generation 0 means no identity was ever set."""

    worker_id: str = ""
    generation: int = 0


class IdentityError(ValueError):
    """An identity change this rank refuses (bad worker id, or a generation not above the
    one it holds)."""


def check_worker_id(worker_id: str) -> None:
    """Raise IdentityError unless `worker_id` is 1 to MAX_WORKER_ID_BYTES bytes of UTF-8
    without control characters (the label rule of common/labels.py)."""
    if not isinstance(worker_id, str):
        raise IdentityError("worker_id must be a non-empty string")
    problem = label_problem(worker_id, MAX_WORKER_ID_BYTES)
    if problem is not None:
        raise IdentityError(
            f"worker_id is not 1 to {MAX_WORKER_ID_BYTES} bytes without control characters ({problem.value})"
        )


class WorkerIdentity:
    """Holds one immutable IdentityState in `current`; replacing it is a single attribute
    store, so readers (both sample paths) never need the lock."""

    def __init__(self, worker_id: str = "") -> None:
        if worker_id:
            check_worker_id(worker_id)
        self._lock = threading.Lock()
        # An id given at start (`enginectl serve --worker-id`) is generation 1.
        self.current = IdentityState(worker_id, 1) if worker_id else IdentityState()

    def set(self, worker_id: str, generation: int) -> IdentityState:
        """Hold `worker_id` at `generation` from now on and return the new state.

        Setting exactly the state held is a no-op (a safe retry). Otherwise `generation` must
        be above the one held, so generations only grow on a rank.
        """
        check_worker_id(worker_id)
        with self._lock:
            held = self.current
            if held.worker_id == worker_id and held.generation == generation:
                return held
            if generation <= held.generation:
                raise IdentityError(f"generation {generation} is not above the held generation {held.generation}")
            self.current = IdentityState(worker_id, generation)
            return self.current
