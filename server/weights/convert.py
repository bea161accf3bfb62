"""Proto <-> domain conversions of the weights room: how a value of the version ledger, of an
update or of the engine contract is written in a message of enginectl.weights.v1, and how a
request's field is read into one.

Runs in the `enginectl serve` process. Servicers (services/version.py, services/updates.py) and
cores (generation.py, groups.py, plans.py, outcome.py, staging.py, updates.py) all import it, and it
imports no other module of server/weights/ but the ledger (whose states it writes): no import
circle can run through it. Which message an RPC answers with is its core's or servicer's
business; how each value is spelled in it is this module's.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import duration_pb2, timestamp_pb2

from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import LoadResult, StageResult
from enginectl.server.errors import Reason, invalid_field
from enginectl.server.limits import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from enginectl.server.weights.version.ledger import Fingerprint, VersionState
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_version_pb2 as wv_pb2
from enginectl.weights.v1 import weight_version_service_pb2 as wvs_pb2

PAUSE_MODES = {pb2.PAUSE_MODE_ABORT: "abort", pb2.PAUSE_MODE_WAIT: "wait", pb2.PAUSE_MODE_KEEP: "keep"}
PAUSE_MODE_PROTO = {name: mode for mode, name in PAUSE_MODES.items()}

# --- durations and timeouts -----------------------------------------------------------------


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def parse_timeout(
    field: str,
    value: duration_pb2.Duration,
    present: bool,
    default: float = DEFAULT_TIMEOUT_S,
    maximum: float = MAX_TIMEOUT_S,
) -> float:
    """A request's timeout in seconds: `default` when absent; TIMEOUT_INVALID unless in (0, maximum]."""
    if not present:
        return default
    # Not ToTimedelta(): a Duration beyond timedelta's range (seconds near 2**63) raised
    # OverflowError, which reached the caller as UNKNOWN.
    seconds = value.ToNanoseconds() / 1e9
    if seconds <= 0 or seconds > maximum:
        raise invalid_field(Reason.TIMEOUT_INVALID, field, f"must be in (0, {maximum:.0f}s]")
    return seconds


# --- pause modes ----------------------------------------------------------------------------


def parse_pause_mode(field: str, mode: pb2.PauseMode.ValueType) -> str:
    """ "abort", "wait" or "keep"; unset means KEEP, as the proto says."""
    if mode == pb2.PAUSE_MODE_UNSPECIFIED:
        return "keep"
    if mode not in PAUSE_MODES:
        raise invalid_field(Reason.PAUSE_MODE_INVALID, field, "must be ABORT, WAIT or KEEP")
    return PAUSE_MODES[mode]


# --- versions -------------------------------------------------------------------------------


def source_proto(source: WeightSource) -> wv_pb2.WeightSource.ValueType:
    """The proto's WeightSource of the same name (WEIGHT_SOURCE_<name>)."""
    return wv_pb2.WeightSource.Value(f"WEIGHT_SOURCE_{source.value}")


def weight_version_proto(state: VersionState) -> wv_pb2.WeightVersion:
    """The WeightVersion message for a ledger state."""
    msg = wv_pb2.WeightVersion(
        declared=state.declared,
        revision=state.revision,
        incarnation=state.incarnation,
        etag=state.etag,
        source=source_proto(state.source),
    )
    if state.version is not None:
        msg.version = state.version
    if state.declare_time is not None:
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(int(state.declare_time * 1e9))
        msg.declare_time.CopyFrom(stamp)
    if state.fingerprint is not None:
        msg.fingerprint.CopyFrom(fingerprint_proto(state.fingerprint))
    if state.last_failure is not None:
        failure = state.last_failure
        msg.last_failure.reason = failure.reason
        msg.last_failure.cause = failure.cause
        msg.last_failure.message = failure.message
        msg.last_failure.attempted_version = failure.attempted_version
        msg.last_failure.operation = failure.operation
        msg.last_failure.time.FromNanoseconds(int(failure.time * 1e9))
    return msg


def verify_response(
    verdict: wvs_pb2.VerifyVerdict.ValueType,
    recorded: Fingerprint | None,
    current: Fingerprint,
    state: VersionState,
) -> wvs_pb2.VerifyWeightsResponse:
    """VerifyWeights' answer: the overall `verdict`, and per rank its recorded and current
    digests (a rank matches when they are equal; every rank is UNDECLARED when the whole is)."""
    recorded_ranks = dict(recorded.ranks) if recorded is not None else {}
    recorded_workers = {(r, w): d for r, w, d in recorded.workers} if recorded is not None else {}

    def judged(before: str, now: str) -> wvs_pb2.VerifyVerdict.ValueType:
        if verdict == wvs_pb2.VERIFY_VERDICT_UNDECLARED:
            return wvs_pb2.VERIFY_VERDICT_UNDECLARED
        return wvs_pb2.VERIFY_VERDICT_MATCH if before == now else wvs_pb2.VERIFY_VERDICT_DRIFTED

    ranks = []
    for rank, digest in current.ranks:
        before = recorded_ranks.get(rank, "")
        workers = [
            wvs_pb2.WorkerVerification(
                worker_rank=worker,
                verdict=judged(recorded_workers.get((r, worker), ""), now),
                recorded_digest=recorded_workers.get((r, worker), ""),
                current_digest=now,
            )
            for r, worker, now in current.workers
            if r == rank
        ]
        ranks.append(
            wvs_pb2.RankVerification(
                dp_rank=rank,
                verdict=judged(before, digest),
                recorded_digest=before,
                current_digest=digest,
                workers=workers,
            )
        )
    return wvs_pb2.VerifyWeightsResponse(
        verdict=verdict, method=current.method, ranks=ranks, weight_version=weight_version_proto(state)
    )


def fingerprint_proto(fingerprint: Fingerprint) -> wv_pb2.WeightFingerprint:
    return wv_pb2.WeightFingerprint(
        method=fingerprint.method,
        digest=fingerprint.digest,
        ranks=[wv_pb2.RankFingerprint(dp_rank=rank, digest=digest) for rank, digest in fingerprint.ranks],
    )


# --- per-rank results -----------------------------------------------------------------------


def worker_load_proto(result: LoadResult | StageResult) -> pb2.WorkerLoad:
    """One worker's load (or stage) result as the Operation shows it; a stage reached no model."""
    if isinstance(result, StageResult):
        tensors, nbytes, modified = result.tensors, result.nbytes, False
    else:
        tensors, nbytes, modified = result.tensors_loaded, result.bytes_loaded, result.weights_modified
    return pb2.WorkerLoad(
        worker_rank=result.worker_rank,
        tensors_loaded=tensors,
        bytes_loaded=nbytes,
        weights_modified=modified,
        error_cause=result.error.cause if result.error is not None else "",
    )


def load_results_proto(results: Iterable[LoadResult | StageResult]) -> list[pb2.RankUpdateResult]:
    """Workers' load (or stage) results folded per DP rank: a rank loaded what every worker of
    it loaded (with tensor parallelism each loads every tensor, its shard of it), in the time of
    its slowest worker (a stage: none); each worker's own result beside it."""
    per_rank: dict[int, list[pb2.WorkerLoad]] = {}
    seconds: dict[int, float] = {}
    for r in results:
        per_rank.setdefault(r.dp_rank, []).append(worker_load_proto(r))
        if isinstance(r, LoadResult):
            seconds[r.dp_rank] = max(seconds.get(r.dp_rank, 0.0), r.duration)
    ranks = []
    for rank in sorted(per_rank):
        workers = sorted(per_rank[rank], key=lambda w: w.worker_rank)
        result = pb2.RankUpdateResult(
            dp_rank=rank,
            tensors_loaded=min(w.tensors_loaded for w in workers),
            bytes_loaded=min(w.bytes_loaded for w in workers),
            workers=workers,
        )
        if rank in seconds:
            result.duration.CopyFrom(duration(seconds[rank]))
        ranks.append(result)
    return ranks
