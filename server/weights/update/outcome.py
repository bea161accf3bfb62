"""How a weight update ends: the Operation's response on success, its error on failure.

Runs in the `enginectl serve` process, on the control loop; pure (no engine calls): the side
effects of an ending (resume, hold paused, record the failure) stay in run.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from enginectl.contract.engine import Cause, LoadResult
from enginectl.server.errors import ControlPlaneError, Reason
from enginectl.server.weights.convert import duration, load_results_proto, weight_version_proto
from enginectl.server.weights.update.operations import UpdateOperation
from enginectl.server.weights.update.plans import UpdatePlan
from enginectl.server.weights.version.ledger import VersionState
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

# Failure causes -> gRPC code of the operation's error.
CAUSE_CODES: dict[str, grpc.StatusCode] = {
    Cause.UPDATE_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cause.GROUP_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cause.UPDATE_CANCELLED: grpc.StatusCode.CANCELLED,
    Cause.STREAM_BROKEN: grpc.StatusCode.CANCELLED,
    Cause.DATA_SIZE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Cause.CHUNK_OUT_OF_ORDER: grpc.StatusCode.INVALID_ARGUMENT,
    Cause.CHUNK_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Cause.HEADER_REQUIRED: grpc.StatusCode.INVALID_ARGUMENT,
    Cause.GROUP_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Cause.GROUP_BROKEN: grpc.StatusCode.FAILED_PRECONDITION,
    Cause.ENGINE_DEAD: grpc.StatusCode.UNAVAILABLE,
    Cause.ETAG_MISMATCH: grpc.StatusCode.ABORTED,
    Cause.LOAD_FAILED: grpc.StatusCode.INTERNAL,
    Cause.IPC_HANDLE_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    Cause.WORKER_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cause.TRANSFER_STEP_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cause.TRANSFER_FAILED: grpc.StatusCode.INTERNAL,
    Cause.WEIGHTS_NOT_FINITE: grpc.StatusCode.DATA_LOSS,  # the weights in memory compute garbage
    Cause.WEIGHTS_MISMATCH: grpc.StatusCode.DATA_LOSS,  # a layer computes with bytes no one sent
    Reason.STAGING_LIMIT_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a transfer stage's batch (transfer.py)
}

_CAUSES = frozenset(c.value for c in Cause)


@dataclass
class UpdateFailed(Exception):
    """The update stops: `cause` is a Cause, or the reason of a ControlPlaneError raised inside it;
    `modified`: a tensor was written before it stopped."""

    cause: str
    message: str
    modified: bool
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cause = Cause(self.cause).value if self.cause in _CAUSES else str(self.cause)

    def error(self, operation: str) -> ControlPlaneError:
        """The operation's error: the cause itself before any tensor was written, PARTIAL_UPDATE
        (with the cause in its metadata) after."""
        code = CAUSE_CODES.get(self.cause, grpc.StatusCode.INTERNAL)
        if not self.modified:
            return ControlPlaneError(code, self.cause, self.message, metadata=dict(self.metadata, operation=operation))
        return ControlPlaneError(
            code,
            Reason.PARTIAL_UPDATE,
            f"the update failed after writing began ({self.cause}: {self.message}); the weights may "
            "be mixed: the version is undeclared and generation stays paused until an update succeeds "
            "or ResumeGeneration(force=true)",
            metadata={**self.metadata, "cause": self.cause, "operation": operation},
        )


@dataclass(frozen=True)
class UpdatePause:
    """How the update found generation: whether it paused it itself, how many requests were
    in flight then, and how long pausing took."""

    by_update: bool = False
    in_flight: int = 0
    seconds: float = 0.0
    # Paused by a caller's PauseGeneration when the update began: a ResumeGeneration that
    # arrives while it runs is deferred to its end, so the update resumes then.
    caller_held: bool = False

    @property
    def resumes(self) -> bool:
        """Whether the update resumes generation at its end (unless a caller holds it then)."""
        return self.by_update or self.caller_held


def success_response(
    plan: UpdatePlan,
    state: VersionState,
    results: list[LoadResult],
    started: float,
    pause: UpdatePause,
    resumed: bool,
    cache_reset: bool,
) -> pb2.UpdateWeightsResponse:
    """The Operation's response: the new version, per-rank results, what the pause did;
    `cache_reset`: the prefix cache was reset (as asked, or always after a partial update)."""
    return pb2.UpdateWeightsResponse(
        weight_version=weight_version_proto(state),
        ranks=load_results_proto(results),
        num_paused_requests=pause.in_flight if pause.by_update and plan.pause_mode == "keep" else 0,
        num_aborted_requests=pause.in_flight if pause.by_update and plan.pause_mode == "abort" else 0,
        prefix_cache_reset=cache_reset,
        generation_resumed=resumed,
        pause_duration=duration(pause.seconds),
        duration=duration(time.monotonic() - started),
    )


def report_finished(
    on_finished: Callable[[str, str, int, float], None] | None,
    op: UpdateOperation,
    plan: UpdatePlan,
    result: str,
    nbytes: int,
) -> None:
    """Tell `on_finished` how `op` ended: (source, result, bytes loaded, seconds); `result` is
    "ok", "failed", "partial" (failed after writing began) or "cancelled" (before it began);
    the duration is the Operation's (end_time - start_time)."""
    if on_finished is not None:
        nanos = op.metadata.end_time.ToNanoseconds() - op.metadata.start_time.ToNanoseconds()
        on_finished(plan.source.value.lower(), result, nbytes, max(nanos, 0) / 1e9)
