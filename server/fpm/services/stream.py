"""ForwardPassMetricsService servicer: StreamForwardPassMetrics over an FpmRelay.

Runs in the `enginectl serve` process, on the control loop. Thin on purpose: it validates
the request, translates it into a relay subscription, and turns what the subscription
hands out into batch and progress messages; the rules live in server/fpm/relay.py.

Batches go out pre-encoded: each sample's wire form is built once, by the first stream that
sends it (server/fpm/samples.py `Relayed.stamp`), and shared by every stream, and a batch message is
their concatenation (the same bytes protobuf would produce): copying each sample into a
message per stream and serializing it again would cost the relay most of its CPU. So the
service is registered with `add_to_server` here, not the generated function.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as pb2
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as pb2_grpc
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field, out_of_range
from enginectl.server.fpm.relay import FpmRelay, RelayClosed
from enginectl.server.fpm.samples import Relayed, SampleFilter, varint
from enginectl.server.limits import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE, MAX_FILTER_ENTRIES, MAX_WORKER_ID_BYTES
from enginectl.server.servicer_context import ServicerContext

# A stream that sent nothing for this long sends a progress message.
PROGRESS_INTERVAL_S = 1.0


def encode_batch(samples: list[Relayed], missed: int) -> bytes:
    """A StreamForwardPassMetricsResponse holding a batch, in wire form."""
    body = b"".join([r.wire or r.stamp() for r in samples])
    if missed:
        body += b"\x10" + varint(missed)  # ForwardPassMetricsBatch.missed = 2
    return b"\x0a" + varint(len(body)) + body  # StreamForwardPassMetricsResponse.batch = 1


def _serialize(response: bytes | pb2.StreamForwardPassMetricsResponse) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def parse_filter(request: pb2.StreamForwardPassMetricsRequest) -> SampleFilter:
    """The relay filter for a request; ControlPlaneError FILTER_INVALID if it is malformed."""
    worker_ids = list(request.filter.worker_ids)
    dp_ranks = list(request.filter.dp_ranks)
    for field, values in (("filter.worker_ids", worker_ids), ("filter.dp_ranks", dp_ranks)):
        if len(values) > MAX_FILTER_ENTRIES:
            raise invalid_field(
                Reason.FILTER_INVALID, field, f"{len(values)} entries; at most {MAX_FILTER_ENTRIES} allowed"
            )
    for i, worker_id in enumerate(worker_ids):
        size = len(worker_id.encode("utf-8"))
        if not 1 <= size <= MAX_WORKER_ID_BYTES:
            raise invalid_field(
                Reason.FILTER_INVALID,
                f"filter.worker_ids[{i}]",
                f"{size} bytes of UTF-8; 1 to {MAX_WORKER_ID_BYTES} allowed",
            )
    for i, rank in enumerate(dp_ranks):
        if rank < 0:
            raise invalid_field(
                Reason.FILTER_INVALID, f"filter.dp_ranks[{i}]", f"{rank} is negative; ranks count from 0"
            )
    return SampleFilter(
        worker_ids=frozenset(worker_ids) or None,
        dp_ranks=frozenset(dp_ranks) or None,
        include_heartbeats=request.include_heartbeats,
    )


def parse_batch_size(request: pb2.StreamForwardPassMetricsRequest) -> int:
    if request.max_batch_size > MAX_BATCH_SIZE:
        raise invalid_field(
            Reason.MAX_BATCH_SIZE_TOO_LARGE,
            "max_batch_size",
            f"{request.max_batch_size}; at most {MAX_BATCH_SIZE} allowed",
        )
    return request.max_batch_size or DEFAULT_BATCH_SIZE


def add_to_server(servicer: ForwardPassMetricsServicer, server: grpc.aio.Server) -> None:
    """Register like the generated add_ForwardPassMetricsServiceServicer_to_server, with a
    response serializer that passes pre-encoded batches through."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.StreamForwardPassMetrics,
        request_deserializer=pb2.StreamForwardPassMetricsRequest.FromString,
        response_serializer=_serialize,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                pb2.DESCRIPTOR.services_by_name["ForwardPassMetricsService"].full_name,
                {"StreamForwardPassMetrics": handler},
            ),
        )
    )


class ForwardPassMetricsServicer(pb2_grpc.ForwardPassMetricsServiceServicer):
    """Serves StreamForwardPassMetrics from one relay."""

    def __init__(self, relay: FpmRelay) -> None:
        self._relay = relay

    def _progress(self, sequence: int) -> pb2.StreamForwardPassMetricsResponse:
        relay = self._relay
        return pb2.StreamForwardPassMetricsResponse(
            progress=pb2.ForwardPassMetricsProgress(
                sequence=sequence,
                head_sequence=relay.head,
                oldest_sequence=relay.oldest,
                incarnation=relay.incarnation,
            )
        )

    # Also yields pre-encoded batches (bytes), which the serializer of `add_to_server` passes
    # through: wider than the generated stub's return type.
    async def StreamForwardPassMetrics(  # type: ignore[override]
        self, request: pb2.StreamForwardPassMetricsRequest, context: ServicerContext
    ) -> AsyncIterator[bytes | pb2.StreamForwardPassMetricsResponse]:
        relay = self._relay
        sample_filter = parse_filter(request)
        max_batch = parse_batch_size(request)
        resume_after = None
        if request.HasField("resume_after_sequence"):
            resume_after = request.resume_after_sequence
            if request.resume_incarnation and request.resume_incarnation != relay.incarnation:
                raise out_of_range(
                    Reason.INCARNATION_CHANGED,
                    # Echo a bounded prefix: the whole status must fit in gRPC's trailers (8 KiB).
                    f"resume_incarnation {request.resume_incarnation[:64]!r} is not this server's "
                    f"({relay.incarnation!r}): it restarted and sequences count afresh",
                    incarnation=relay.incarnation,
                )
        try:
            subscription = relay.subscribe(sample_filter, resume_after)
        except RelayClosed as closed:
            raise _closed(closed) from None
        try:
            yield self._progress(relay.head if resume_after is None else resume_after)
            while True:
                if not await subscription.wait(PROGRESS_INTERVAL_S):
                    yield self._progress(relay.head)
                    continue
                samples, missed = subscription.take(max_batch)
                if samples:
                    yield encode_batch(samples, missed)
                else:  # a replay scanned a stretch its filter rejects: let others run
                    await asyncio.sleep(0)
        except RelayClosed as closed:
            raise _closed(closed) from None
        finally:
            subscription.close()


def _closed(closed: RelayClosed) -> ControlPlaneError:
    """UNAVAILABLE with the relay's reason: SHUTTING_DOWN, or ENGINE_DEAD."""
    return ControlPlaneError(grpc.StatusCode.UNAVAILABLE, closed.reason, closed.message)
