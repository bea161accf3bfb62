"""What the client commands show on a terminal: one text view per result type.

Runs in the `enginectl` process; pure functions from the client's dataclasses to text (the
JSON output is those dataclasses themselves, see output.py). `render` picks the view by
the value's type.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import singledispatch

from enginectl.cli.output import Columns, cell, fields, human_bytes, human_seconds, table, when
from enginectl.client.fpm import FpmSample
from enginectl.client.trainer_types import (
    GenerationState,
    PauseResult,
    ServerInfo,
    StagedWeights,
    UpdateOperation,
    UpdateResult,
    Verification,
)
from enginectl.client.types import IdentityAcks, RankIdentity, WeightVersion, WorkerIdentity

DIGEST_CHARS = 16  # digests are long; a table shows their start (-o json has them whole)


def _label(value: str) -> str:
    """An enum name for people: UNSPECIFIED reads as "-"."""
    return "-" if value == "UNSPECIFIED" else value


def _version(v: WeightVersion) -> str:
    label = v.version if v.declared else "<undeclared>"
    return f"{label} (revision {v.revision})"


def _blocks(*blocks: str) -> str:
    return "\n\n".join(b for b in blocks if b)


@singledispatch
def render(value: object) -> str:
    """The terminal view of a result."""
    return cell(value)


@render.register
def _(v: WeightVersion) -> str:
    failure = v.last_failure
    pairs: list[tuple[str, object]] = [
        ("Version", v.version if v.declared else "<undeclared>"),
        ("Declared", v.declared),
        ("Revision", v.revision),
        ("Source", _label(v.source.value)),
        ("Declared at", when(v.declare_time)),
        ("Etag", v.etag),
        ("Incarnation", v.incarnation),
    ]
    if failure is not None:
        pairs += [
            ("Last failure", f"{failure.reason}: {failure.message}"),
            ("Failed at", when(failure.time)),
            ("Attempted version", failure.attempted_version),
            ("Operation", failure.operation),
        ]
    return fields(pairs)


def _rank_results(result: UpdateResult) -> str:
    """A row per rank; with more than one worker per rank (tensor parallelism), a row per worker."""
    if all(len(r.workers) <= 1 for r in result.ranks):
        return table(
            ("RANK", "TENSORS", "BYTES", "DURATION"),
            [
                (r.dp_rank, r.tensors_loaded, human_bytes(r.bytes_loaded), human_seconds(r.duration))
                for r in result.ranks
            ],
        )
    return table(
        ("RANK", "WORKER", "TENSORS", "BYTES"),
        [
            (r.dp_rank, w.worker_rank, w.tensors_loaded, human_bytes(w.bytes_loaded))
            for r in result.ranks
            for w in r.workers
        ],
    )


@render.register
def _(r: UpdateResult) -> str:
    paused = f"{human_seconds(r.pause_duration)} ({r.num_paused_requests} kept, {r.num_aborted_requests} aborted)"
    summary = fields(
        [
            ("Operation", r.operation),
            ("Weight version", _version(r.weight_version)),
            ("Source", _label(r.weight_version.source.value)),
            ("Duration", human_seconds(r.duration)),
            ("Paused", paused),
            ("Prefix cache reset", r.prefix_cache_reset),
            ("Generation resumed", r.generation_resumed),
        ]
    )
    return _blocks(summary, _rank_results(r))


@render.register
def _(op: UpdateOperation) -> str:
    p = op.progress
    pairs: list[tuple[str, object]] = [
        ("Name", op.name),
        ("Done", op.done),
        ("Phase", p.phase),
        ("Source", _label(p.source)),
        ("Version", p.weight_version),
        (
            "Progress",
            f"{p.tensors_done}/{p.tensors_total} tensors, {human_bytes(p.bytes_done)} of {human_bytes(p.bytes_total)}",
        ),
        ("Weights modified", p.weights_modified),
    ]
    if op.error is not None:
        pairs.append(("Error", str(op.error)))
    ranks = table(
        ("RANK", "PHASE", "TENSORS", "BYTES"),
        [(r.dp_rank, r.phase, r.tensors_done, human_bytes(r.bytes_done)) for r in p.ranks],
    )
    if op.response is not None:
        return _blocks(fields(pairs), _rank_results(op.response))
    return _blocks(fields(pairs), ranks if p.ranks else "")


@render.register
def _(staged: StagedWeights) -> str:
    return fields(
        [
            ("Staged", staged.name),
            ("Source", _label(staged.source)),
            ("Version", staged.weight_version),
            ("Tensors", staged.tensors),
            ("Bytes", human_bytes(staged.bytes)),
            ("Fingerprint", staged.fingerprint[:DIGEST_CHARS]),
            ("Expires", staged.expire_time),
            ("Operation", staged.operation),
        ]
    )


def operations_table(ops: Sequence[UpdateOperation]) -> str:
    """`operation list`: a row per operation, newest first; the error's reason if it failed."""
    if not ops:
        return "no operations"
    return table(
        ("NAME", "PHASE", "SOURCE", "VERSION", "TENSORS", "BYTES", "ERROR"),
        [
            (
                op.name,
                op.progress.phase,
                _label(op.progress.source),
                op.progress.weight_version,
                f"{op.progress.tensors_done}/{op.progress.tensors_total}",
                human_bytes(op.progress.bytes_done),
                (op.error.reason or op.error.code.name) if op.error is not None else "",
            )
            for op in ops
        ],
    )


@render.register
def _(v: Verification) -> str:
    summary = fields([("Verdict", v.verdict), ("Method", v.method), ("Weight version", _version(v.weight_version))])
    if all(len(r.workers) <= 1 for r in v.ranks):
        ranks = table(
            ("RANK", "VERDICT", "RECORDED", "CURRENT"),
            [
                (r.dp_rank, r.verdict, r.recorded_digest[:DIGEST_CHARS], r.current_digest[:DIGEST_CHARS])
                for r in v.ranks
            ],
        )
    else:  # tensor parallelism: each worker's shard, so a drift names its worker
        ranks = table(
            ("RANK", "WORKER", "VERDICT", "RECORDED", "CURRENT"),
            [
                (r.dp_rank, w.worker_rank, w.verdict, w.recorded_digest[:DIGEST_CHARS], w.current_digest[:DIGEST_CHARS])
                for r in v.ranks
                for w in r.workers
            ],
        )
    return _blocks(summary, ranks)


@render.register
def _(info: ServerInfo) -> str:
    about = fields(
        [
            ("Model", info.model),
            ("Served model names", info.served_model_names),
            ("Dtype", info.dtype),
            ("Data parallel", info.data_parallel_size),
            ("Managed ranks", _range(info.managed_ranks)),
            ("Engine", info.engine_id),
            ("Tensor parallel", info.tensor_parallel_size),
            ("Workers", info.num_workers),
            ("Update backends", ", ".join(info.backends)),
            ("Token required", info.auth_required),
            ("Fingerprint", info.fingerprint_method),
            ("Allowed weight roots", info.allowed_weight_roots),
            ("Max chunk", human_bytes(info.max_chunk_bytes)),
            ("Incarnation", info.incarnation),
            ("Supported RPCs", info.supported_rpcs),
        ]
    )
    if not info.ranks:
        return about
    rows = [
        (r.dp_rank, r.host, "yes" if r.local else "no (another node)", r.num_workers, r.enginectl_version)
        for r in info.ranks
    ]
    return _blocks(about, table(("RANK", "HOST", "LOCAL", "WORKERS", "ENGINECTL"), rows))


def _range(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start) if ranks else "-"


def _generation(state: GenerationState, extra: Sequence[tuple[str, object]] = ()) -> str:
    summary = fields(
        [
            ("Paused", state.paused),
            ("Reason", _label(state.reason)),
            ("Mode", _label(state.mode)),
            ("Running", state.num_running_requests),
            ("Waiting", state.num_waiting_requests),
            ("Update", state.update_operation),
            ("Staged", state.staged.name if state.staged is not None else None),
            *extra,
        ]
    )
    ranks = table(
        ("RANK", "PAUSED", "RUNNING", "WAITING"),
        [(r.dp_rank, r.paused, r.num_running_requests, r.num_waiting_requests) for r in state.ranks],
    )
    return _blocks(summary, ranks)


@render.register
def _(state: GenerationState) -> str:
    return _generation(state)


@render.register
def _(r: PauseResult) -> str:
    return _generation(
        r.state,
        [
            ("Was paused", r.was_paused),
            ("Requests kept", r.num_paused_requests),
            ("Requests aborted", r.num_aborted_requests),
            ("Pause took", human_seconds(r.pause_duration)),
        ],
    )


def _identity_table(ranks: Sequence[RankIdentity]) -> str:
    return table(("RANK", "WORKER ID", "GENERATION"), [(r.dp_rank, r.worker_id, r.identity_generation) for r in ranks])


@render.register
def _(identity: WorkerIdentity) -> str:
    summary = fields([("Consistent", identity.consistent), ("Awaits worker id", identity.await_worker_id)])
    return _blocks(summary, _identity_table(identity.ranks))


@render.register
def _(acks: IdentityAcks) -> str:
    return _identity_table(acks.ranks)


# --- streams: a header once, then one row per event --------------------------------------

VERSION_COLUMNS = Columns((("REVISION", 8), ("VERSION", 24), ("SOURCE", 10), ("DECLARED AT", 23), ("ETAG", 0)))


def version_row(v: WeightVersion) -> Sequence[object]:
    return (v.revision, v.version if v.declared else "<undeclared>", _label(v.source.value), v.declare_time, v.etag)


SAMPLE_COLUMNS = Columns(
    (
        ("SEQUENCE", 8),
        ("TIME", 12),
        ("WORKER", 12),
        ("RANK", 4),
        ("KIND", 9),
        ("RUNNING", 7),
        ("WAITING", 7),
        ("PREFILL", 7),
        ("DECODE", 6),
        ("KV", 6),
        ("IDLE", 5),
        ("REV", 0),
    )
)


def sample_row(s: FpmSample) -> Sequence[object]:
    time = s.emit_time.strftime("%H:%M:%S.%f")[:12] if s.emit_time else None
    return (
        s.sequence,
        time,
        s.worker_id,
        s.dp_rank,
        s.kind.value,
        s.num_running,
        s.num_waiting,
        s.scheduled.sum_prefill_tokens,
        s.scheduled.num_decode_requests,
        f"{100 * s.kv_cache_usage:.1f}%",
        s.idle,
        s.weight_revision,
    )
