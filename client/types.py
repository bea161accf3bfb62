"""Plain Python views of enginectl resources, so callers never handle raw protobuf."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from enginectl.common.vocabulary import WeightSource as WeightSource  # re-exported
from enginectl.weights.v1 import weight_version_pb2


@dataclass(frozen=True)
class UpdateFailure:
    """Why the last weight update failed after it began writing."""

    reason: str
    message: str
    time: datetime | None
    attempted_version: str
    operation: str
    cause: str = ""  # what made it fail, e.g. "STREAM_BROKEN", "WEIGHTS_NOT_FINITE"


@dataclass(frozen=True)
class WeightVersion:
    """The weight version an engine serves.

    `version` is None exactly when `declared` is False: never a placeholder string.
    """

    declared: bool
    version: str | None
    revision: int
    incarnation: str
    etag: str
    source: WeightSource
    declare_time: datetime | None
    last_failure: UpdateFailure | None

    @classmethod
    def from_proto(cls, msg: weight_version_pb2.WeightVersion) -> WeightVersion:
        failure = None
        if msg.HasField("last_failure"):
            f = msg.last_failure
            failure = UpdateFailure(
                reason=f.reason,
                message=f.message,
                time=_time(f, "time"),
                attempted_version=f.attempted_version,
                operation=f.operation,
                cause=f.cause,
            )
        return cls(
            declared=msg.declared,
            version=msg.version if msg.HasField("version") else None,
            revision=msg.revision,
            incarnation=msg.incarnation,
            etag=msg.etag,
            source=WeightSource(weight_version_pb2.WeightSource.Name(msg.source).removeprefix("WEIGHT_SOURCE_")),
            declare_time=_time(msg, "declare_time"),
            last_failure=failure,
        )


def _time(msg: object, field: str) -> datetime | None:
    if not msg.HasField(field):  # type: ignore[attr-defined]
        return None
    return getattr(msg, field).ToDatetime(tzinfo=timezone.utc)


@dataclass(frozen=True)
class RankIdentity:
    """The worker identity one data-parallel rank holds (`worker_id` "" while it has none;
    `identity_generation` 0 then)."""

    dp_rank: int
    worker_id: str
    identity_generation: int


@dataclass(frozen=True)
class WorkerIdentity:
    """GetWorkerIdentity: every rank's identity as its EngineCore reports it now.

    `consistent` when every rank holds the same non-empty id at the same generation;
    `await_worker_id` when the server was started with `--await-worker-id`.
    """

    ranks: tuple[RankIdentity, ...]
    consistent: bool
    await_worker_id: bool


@dataclass(frozen=True)
class IdentityAcks:
    """SetWorkerIdentity succeeded: one ack per rank, in dp_rank order."""

    ranks: tuple[RankIdentity, ...]
