"""The update-group messages of the engine contract (contract/engine.py): what the server asks
a worker to join (WorkerRpc.INIT_GROUP) and what the worker answers (INIT_GROUP,
GROUP_JOIN_STATE). Shared by the server (server/weights/sources/groups.py) and the worker
(worker/weights/groups.py, worker/weights/transfer/engine.py).
"""

from __future__ import annotations

import enum

import msgspec


class Backend(str, enum.Enum):
    GLOO = "gloo"
    NCCL = "nccl"


class GroupSpec(msgspec.Struct, frozen=True):
    """A private process group with the trainer (rank 0); this server's workers take ranks
    rank_offset.. in worker order."""

    name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout: float  # seconds: the rendezvous and every collective
    backend: Backend
    # WorkerLayout.first_worker: a worker's rank is rank_offset + its global index - this.
    first_worker: int = 0


class GroupJoined(msgspec.Struct, frozen=True):
    """A worker's answer to INIT_GROUP and GROUP_JOIN_STATE: still `joining`, the rank it
    took, or why it could not join."""

    dp_rank: int
    rank: int
    failure: str = ""  # "", or Cause.GROUP_TIMEOUT / Reason.GROUP_INIT_FAILED
    message: str = ""
    joining: bool = False  # the join runs on the worker's thread: ask again
