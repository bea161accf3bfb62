"""What every weight-update request of the trainer client carries: pause mode, timeout,
version, etag, request id. Runs wherever the client runs; imports neither torch nor vLLM.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf import duration_pb2

from enginectl.weights.v1 import weight_update_service_pb2 as pb2

PAUSE_MODES = {"abort": pb2.PAUSE_MODE_ABORT, "wait": pb2.PAUSE_MODE_WAIT, "keep": pb2.PAUSE_MODE_KEEP}
GRACE_S = 60.0  # beyond an update's own timeout, for the server to report its end


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def parse_pause_mode(mode: str) -> pb2.PauseMode.ValueType:
    """The PauseMode for "keep", "abort" or "wait" (any case); ValueError otherwise."""
    try:
        return PAUSE_MODES[mode.lower()]
    except KeyError:
        raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, not {mode!r}") from None


# The messages that carry the shared update fields.
Request = TypeVar(
    "Request",
    pb2.UpdateWeightsFromDiskRequest,
    pb2.TensorStreamHeader,
    pb2.UpdateWeightsFromDistributedRequest,
    pb2.UpdateWeightsFromIpcRequest,
    pb2.CommitStagedWeightsRequest,
)


@dataclass(frozen=True)
class UpdateOptions:
    """Options every update takes (see UpdateWeightsFromDiskRequest)."""

    version: str | None = None
    etag: str | None = None
    request_id: str | None = None
    pause_mode: str = "keep"
    reset_prefix_cache: bool = True
    timeout: float | None = None
    stage_only: bool = False  # receive into the staging area; commit_staged_weights applies it

    def fill(self, msg: Request) -> Request:
        """Set the shared fields on a request or stream header; returns it."""
        if self.version is not None:
            msg.weight_version = self.version
        msg.etag = self.etag or ""
        msg.request_id = self.request_id or str(uuid.uuid4())
        msg.pause_mode = parse_pause_mode(self.pause_mode)
        msg.reset_prefix_cache = self.reset_prefix_cache
        if self.timeout is not None:
            msg.timeout.CopyFrom(duration(self.timeout))
        if self.stage_only:
            if isinstance(msg, (pb2.UpdateWeightsFromIpcRequest, pb2.CommitStagedWeightsRequest)):
                raise ValueError(f"{type(msg).__name__} can not be staged")
            msg.stage_only = True
        return msg

    def wait_bound(self) -> float | None:
        """How long to wait for the Operation: the update's timeout plus grace (None: no bound)."""
        return None if self.timeout is None else self.timeout + GRACE_S
