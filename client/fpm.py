"""Plain Python views of forward-pass metrics (FPM) and a typed StreamForwardPassMetrics call.

Runs wherever the client runs (a planner, a notebook); imports neither torch nor vLLM.
Field meanings are those of `enginectl/fpm/v1/forward_pass_metrics.proto`.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Generator, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

import grpc

from enginectl.client._sync import LoopThread
from enginectl.client.client import ChannelConfig
from enginectl.client.errors import from_rpc_error
from enginectl.fpm.v1 import forward_pass_metrics_pb2 as fpm_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as svc_pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as svc_grpc


class SampleKind(str, enum.Enum):
    """What made a sample."""

    UNSPECIFIED = "UNSPECIFIED"
    STEP = "STEP"
    HEARTBEAT = "HEARTBEAT"


class FpmGenerationState(str, enum.Enum):
    """What a rank's generation was doing when it made a sample (the proto's GenerationState;
    named apart from `GenerationState`, which is GetGenerationState's answer)."""

    UNSPECIFIED = "UNSPECIFIED"  # a server that does not report it
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"  # `pause_reason` says who holds the pause
    APPLYING = "APPLYING"  # a weight update is writing the rank's weights


def _enum_name(enum_type: object, value: int, prefix: str) -> str:
    """The proto enum value's name without `prefix`; "UNSPECIFIED" for a value this client
    does not know (a newer server)."""
    try:
        return str(enum_type.Name(value)).removeprefix(prefix)  # type: ignore[attr-defined]
    except ValueError:
        return "UNSPECIFIED"


@dataclass(frozen=True)
class ScheduledRequests:
    """The requests one scheduler step executed (Dynamo's ScheduledRequestMetrics)."""

    num_prefill_requests: int
    sum_prefill_tokens: int
    var_prefill_length: float
    sum_prefill_kv_tokens: int
    num_decode_requests: int
    sum_decode_kv_tokens: int
    var_decode_kv_tokens: float


@dataclass(frozen=True)
class QueuedRequests:
    """The requests waiting on a rank (Dynamo's QueuedRequestMetrics)."""

    num_prefill_requests: int
    sum_prefill_tokens: int
    var_prefill_length: float
    num_decode_requests: int
    sum_decode_kv_tokens: int
    var_decode_kv_tokens: float


@dataclass(frozen=True)
class FpmSample:
    """One forward-pass metrics sample of one data-parallel rank, as relayed."""

    worker_id: str
    dp_rank: int
    counter_id: int
    identity_generation: int
    incarnation: str
    emit_time: datetime | None
    wall_time: float
    idle: bool
    kind: SampleKind
    scheduled: ScheduledRequests
    queued: QueuedRequests
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    dropped_since_last: int
    sequence: int
    weight_revision: int
    schema_version: int
    generation_state: FpmGenerationState = FpmGenerationState.UNSPECIFIED
    # Who holds the pause while PAUSED or APPLYING: "CALLER", "UPDATE", "PARTIAL_UPDATE" or
    # "EXTERNAL" (the names of GenerationState.reason); "UNSPECIFIED" while RUNNING.
    pause_reason: str = "UNSPECIFIED"

    @property
    def generating(self) -> bool:
        """Whether the rank ran generation when it made the sample: RUNNING, or UNSPECIFIED
        (a server that does not report its state, taken as running, as before it could)."""
        return self.generation_state in (FpmGenerationState.RUNNING, FpmGenerationState.UNSPECIFIED)

    @classmethod
    def from_proto(cls, msg: fpm_pb2.ForwardPassMetrics) -> FpmSample:
        s, q = msg.scheduled, msg.queued
        emit = msg.emit_time.ToDatetime(tzinfo=timezone.utc) if msg.HasField("emit_time") else None
        kind = _enum_name(fpm_pb2.SampleKind, msg.kind, "SAMPLE_KIND_")
        state = _enum_name(fpm_pb2.GenerationState, msg.generation_state, "GENERATION_STATE_")
        return cls(
            worker_id=msg.worker_id,
            dp_rank=msg.dp_rank,
            counter_id=msg.counter_id,
            identity_generation=msg.identity_generation,
            incarnation=msg.incarnation,
            emit_time=emit,
            wall_time=msg.wall_time,
            idle=msg.idle,
            kind=SampleKind(kind) if kind in SampleKind.__members__ else SampleKind.UNSPECIFIED,
            scheduled=ScheduledRequests(
                s.num_prefill_requests,
                s.sum_prefill_tokens,
                s.var_prefill_length,
                s.sum_prefill_kv_tokens,
                s.num_decode_requests,
                s.sum_decode_kv_tokens,
                s.var_decode_kv_tokens,
            ),
            queued=QueuedRequests(
                q.num_prefill_requests,
                q.sum_prefill_tokens,
                q.var_prefill_length,
                q.num_decode_requests,
                q.sum_decode_kv_tokens,
                q.var_decode_kv_tokens,
            ),
            kv_cache_usage=msg.kv_cache_usage,
            num_running=msg.num_running,
            num_waiting=msg.num_waiting,
            dropped_since_last=msg.dropped_since_last,
            sequence=msg.sequence,
            weight_revision=msg.weight_revision,
            schema_version=msg.schema_version,
            generation_state=FpmGenerationState(state),
            pause_reason=_enum_name(fpm_pb2.PauseReason, msg.pause_reason, "PAUSE_REASON_"),
        )


@dataclass(frozen=True)
class FpmBatch:
    """Samples of one stream message; `missed` were coalesced away before them (slow reader)."""

    samples: tuple[FpmSample, ...]
    missed: int


@dataclass(frozen=True)
class FpmProgress:
    """Where a stream stands: resume after `sequence` to miss nothing it would have sent."""

    sequence: int
    head_sequence: int
    oldest_sequence: int
    incarnation: str


def stream_request(
    *,
    worker_ids: Iterable[str] = (),
    dp_ranks: Iterable[int] = (),
    include_heartbeats: bool = False,
    resume_after_sequence: int | None = None,
    resume_incarnation: str = "",
    max_batch_size: int = 0,
) -> svc_pb2.StreamForwardPassMetricsRequest:
    """The StreamForwardPassMetrics request for these options (see the proto)."""
    request = svc_pb2.StreamForwardPassMetricsRequest(
        filter=svc_pb2.ForwardPassMetricsFilter(worker_ids=list(worker_ids), dp_ranks=list(dp_ranks)),
        include_heartbeats=include_heartbeats,
        resume_incarnation=resume_incarnation,
        max_batch_size=max_batch_size,
    )
    if resume_after_sequence is not None:
        request.resume_after_sequence = resume_after_sequence
    return request


async def stream_forward_pass_metrics(
    channel: grpc.aio.Channel,
    request: svc_pb2.StreamForwardPassMetricsRequest,
    config: ChannelConfig | None = None,
) -> AsyncIterator[FpmBatch | FpmProgress]:
    """Yield the stream's progress messages and batches; raises EnginectlError (with the
    server's reason, e.g. OutOfRangeError SEQUENCE_EVICTED) when the stream fails."""
    stub = svc_grpc.ForwardPassMetricsServiceStub(channel)
    call = stub.StreamForwardPassMetrics(request, metadata=config.metadata() if config else ())
    try:
        async for response in call:
            if response.HasField("batch"):
                batch = response.batch
                yield FpmBatch(tuple(FpmSample.from_proto(s) for s in batch.samples), batch.missed)
            else:
                p = response.progress
                yield FpmProgress(p.sequence, p.head_sequence, p.oldest_sequence, p.incarnation)
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    finally:
        call.cancel()


async def _on_own_channel(
    config: ChannelConfig, request: svc_pb2.StreamForwardPassMetricsRequest
) -> AsyncIterator[FpmBatch | FpmProgress]:
    async with config.aio_channel() as channel:  # made on the loop that reads it
        async for event in stream_forward_pass_metrics(channel, request, config):
            yield event


def iter_forward_pass_metrics(
    config: ChannelConfig, request: svc_pb2.StreamForwardPassMetricsRequest
) -> Generator[FpmBatch | FpmProgress, None, None]:
    """Blocking: the stream's progress messages and batches, read one message at a time (no
    read-ahead) on a private event-loop thread, over a channel of the stream's own. Closing
    the iterator, or leaving a for loop early, ends the call and the thread. Raises
    EnginectlError as `stream_forward_pass_metrics` does."""
    loop = LoopThread("enginectl-fpm-watch")
    events = loop.iterate(_on_own_channel(config, request))
    try:
        yield from events
    finally:
        events.close()
        loop.close()
