"""Prometheus metrics of the control plane, in vLLM's registry (so they appear on the HTTP
server's `/metrics`). docs/metrics.md lists every one, with its labels and meaning.

Runs in the `enginectl serve` process. The control loop reports what happened (an RPC, an
update, a pause or resume, an identity sync) by calling a method here, which costs one
counter increment or histogram observation (both thread-safe); the gauges read the ledger,
the pause state and the FPM relay at scrape time, on vLLM's HTTP loop. The modules that
report never import prometheus: serve.py hands them these methods as callbacks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from enginectl.server.fpm.relay import FpmRelay
from enginectl.server.weights.sources.channels import DroppedFrames
from enginectl.server.weights.version.ledger import WeightVersionLedger

SOURCES = ("disk", "distributed", "tensors", "ipc")
# How an update ended: cancelled = CancelOperation (or the caller left) before any tensor
# was written; partial = it failed after writing began, however it failed.
UPDATE_RESULTS = ("ok", "failed", "partial", "cancelled")
# Who paused generation, as GetGenerationState's PauseReason says it.
PAUSE_REASONS = ("update", "caller")
# unchanged = every rank already held the identity (a safe retry).
IDENTITY_RESULTS = ("ok", "unchanged", "failed")
TAKEOVER_RESOURCES = ("transfer_engine", "update_group")
# 10 ms .. 10 min: a tiny model from page cache up to a large broadcast.
UPDATE_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
# 1 ms (PauseGeneration + ResumeGeneration back to back) .. 10 min.
PAUSE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GenerationPauses:
    """How long generation stays paused, from the pause to the resume, by who paused it.

    Hears of every pause and resume enginectl makes (server/weights/update/generation.py); a pause
    made through vLLM's own HTTP routes is not seen. A pause still running is in the gauge,
    not yet in the histogram."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "enginectl_generation_pause_seconds",
            "Generation pauses made by enginectl, from the pause to the resume, by reason: update "
            "(a weight update paused it, held after a partial update included) or caller "
            "(PauseGeneration).",
            ["reason"],
            buckets=PAUSE_SECONDS_BUCKETS,
            registry=registry,
        )
        for reason in PAUSE_REASONS:
            self.seconds.labels(reason=reason)
        self._since: float | None = None  # monotonic time of the pause in effect
        self._reason = ""
        paused = Gauge(
            "enginectl_generation_paused",
            "1 while generation is paused by enginectl (an update or PauseGeneration), else 0.",
            registry=registry,
        )
        paused.set_function(lambda: float(self._since is not None))

    def changed(self, reason: str | None) -> None:
        """Generation paused (`reason`: "update" or "caller") or resumed (None); on the
        control loop. A pause while paused changes nothing: the first reason stays."""
        now = time.monotonic()
        if reason is not None:
            if self._since is None:
                self._since, self._reason = now, reason
        elif self._since is not None:
            self.seconds.labels(reason=self._reason).observe(now - self._since)
            self._since = None


class ControlPlaneMetrics:
    """Create once per process (metric names are unique in a registry)."""

    def __init__(self, ledger: WeightVersionLedger, registry: CollectorRegistry = REGISTRY) -> None:
        self.rpcs = Counter(
            "enginectl_rpcs",
            "enginectl gRPC calls finished, by full method name and status code.",
            ["rpc", "code"],
            registry=registry,
        )
        declared = Gauge(
            "enginectl_weight_version_declared",
            "1 while a weight version is declared in this incarnation, else 0.",
            registry=registry,
        )
        declared.set_function(lambda: float(ledger.state.declared))
        revision = Gauge(
            "enginectl_weight_version_revision",
            "Successful weight-version declarations in this incarnation.",
            registry=registry,
        )
        revision.set_function(lambda: float(ledger.state.revision))
        self.updates = Counter(
            "enginectl_weight_updates",
            "Weight updates finished, by source (disk, distributed, tensors, ipc) and result (ok; "
            "failed: nothing written; partial: failed after writing began; cancelled: "
            "cancelled before anything was written).",
            ["source", "result"],
            registry=registry,
        )
        self.update_seconds = Histogram(
            "enginectl_weight_update_duration_seconds",
            "Duration of finished weight updates (their Operation's end_time - start_time), by source and result.",
            ["source", "result"],
            buckets=UPDATE_SECONDS_BUCKETS,
            registry=registry,
        )
        self.update_bytes = Counter(
            "enginectl_weight_update_bytes",
            "Tensor bytes loaded by successful weight updates (summed over ranks), by source.",
            ["source"],
            registry=registry,
        )
        for source in SOURCES:
            self.update_bytes.labels(source=source)
            for result in UPDATE_RESULTS:
                self.updates.labels(source=source, result=result)
                self.update_seconds.labels(source=source, result=result)
        self.staged_bytes = Gauge(
            "enginectl_weight_staged_bytes",
            "Bytes of the staged set waiting for CommitStagedWeights (per worker); 0 while nothing is staged.",
            registry=registry,
        )
        self.pauses = GenerationPauses(registry)
        self.identity_syncs = Counter(
            "enginectl_fpm_identity_syncs",
            "SetWorkerIdentity calls that reached the ranks, by result (ok; unchanged: every "
            "rank already held it; failed: a rank did not ack).",
            ["result"],
            registry=registry,
        )
        for result in IDENTITY_RESULTS:
            self.identity_syncs.labels(result=result)
        self.takeovers = Counter(
            "enginectl_takeovers",
            "Trainer-held resources taken over by a trainer that restarted (an init while the "
            "previous one's was in place), by resource (transfer_engine, update_group); "
            'docs/weights.md, "A trainer that restarts".',
            ["resource"],
            registry=registry,
        )
        for resource in TAKEOVER_RESOURCES:
            self.takeovers.labels(resource=resource)

    def rpc_done(self, rpc: str, code: str) -> None:
        self.rpcs.labels(rpc=rpc, code=code).inc()

    def update_done(self, source: str, result: str, nbytes: int, seconds: float) -> None:
        """An update ended (server/weights/updates.py `on_finished`)."""
        self.updates.labels(source=source, result=result).inc()
        self.update_seconds.labels(source=source, result=result).observe(seconds)
        if nbytes:
            self.update_bytes.labels(source=source).inc(nbytes)

    def pause_changed(self, reason: str | None) -> None:
        """Generation paused by `reason` or resumed (None) (server/weights/update/generation.py)."""
        self.pauses.changed(reason)

    def identity_synced(self, result: str) -> None:
        """A SetWorkerIdentity reached the ranks (server/fpm/identity.py `on_synced`)."""
        self.identity_syncs.labels(result=result).inc()

    def taken_over(self, resource: str) -> None:
        """A trainer took over `resource` (server/weights/transfer.py, sources/groups.py)."""
        self.takeovers.labels(resource=resource).inc()

    def set_staged_bytes(self, nbytes: int) -> None:
        """Staged (two-phase) updates: the bytes of the set held between stage and commit
        (server/weights/update/staging.py), 0 when none is."""
        self.staged_bytes.set(nbytes)


class FpmRelayCollector:
    """The FPM relay's counters and gauges, read from the relay at scrape time (the relay
    only increments plain integers on its hot path)."""

    def __init__(self, relay: FpmRelay, update_frames: DroppedFrames | None = None) -> None:
        self._relay = relay
        self._update_frames = update_frames

    def collect(self) -> Iterator[Metric]:
        relay = self._relay
        stats = relay.stats
        relayed = CounterMetricFamily(
            "enginectl_fpm_samples_relayed",
            "Forward-pass metrics samples the relay sequenced and kept in its ring (every one a "
            "resume can read; under overload some reach live streams only as missed).",
        )
        relayed.add_metric([], stats.accepted)
        dropped = CounterMetricFamily(
            "enginectl_fpm_samples_dropped",
            "Samples dropped at the relay, by reason: unattributed (empty worker_id while "
            "--await-worker-id requires one), malformed, or unkeyed (without this start's "
            "incarnation and channel secret: another start's publisher, or a stranger).",
            labels=["reason"],
        )
        dropped.add_metric(["unattributed"], stats.dropped_unattributed)
        dropped.add_metric(["malformed"], stats.dropped_malformed)
        dropped.add_metric(["unkeyed"], stats.dropped_unkeyed)
        missed = CounterMetricFamily(
            "enginectl_fpm_subscriber_missed",
            "Samples coalesced away from slow stream subscribers' queues (summed over subscribers).",
        )
        missed.add_metric([], stats.subscriber_missed)
        coalesced = CounterMetricFamily(
            "enginectl_fpm_samples_coalesced_at_intake",
            "Samples sequenced while the relay's intake was behind and offered to no live stream "
            "(the latest per worker and rank was; every stream counts the rest in missed).",
        )
        coalesced.add_metric([], stats.coalesced_at_intake)
        subscribers = GaugeMetricFamily(
            "enginectl_fpm_subscribers", "Open StreamForwardPassMetrics streams.", value=relay.subscribers
        )
        backlog = GaugeMetricFamily(
            "enginectl_fpm_subscriber_backlog",
            "Samples waiting in the fullest live stream's queue: how far the slowest subscriber "
            "lags behind the relay (at --fpm-subscriber-queue it coalesces and counts missed).",
            value=relay.backlog(),
        )
        age = GaugeMetricFamily(
            "enginectl_fpm_newest_sample_age_seconds",
            "Now minus the emit_time of the newest sample relayed (any rank; heartbeats count): "
            "stays below the heartbeat interval plus the transport delay while publishers and "
            "relay keep up. Absent before the first sample.",
        )
        newest = relay.newest()
        if newest is not None:
            age.add_metric([], max(time.time() - newest.emit_time.ToNanoseconds() / 1e9, 0.0))
        yield from (relayed, dropped, missed, coalesced, subscribers, backlog, age)
        if self._update_frames is not None:
            update_dropped = CounterMetricFamily(
                "enginectl_update_frames_dropped",
                "Messages on weight updates' channels the server dropped, by reason: unkeyed "
                "(without this start's incarnation and channel secret; docs/multinode.md).",
                labels=["reason"],
            )
            update_dropped.add_metric(["unkeyed"], self._update_frames.unkeyed)
            yield update_dropped


def register_fpm_metrics(
    relay: FpmRelay, update_frames: DroppedFrames | None = None, registry: CollectorRegistry = REGISTRY
) -> FpmRelayCollector:
    """Export the relay's metrics, and the update channels' drops, in `registry` (once per process)."""
    collector = FpmRelayCollector(relay, update_frames)
    registry.register(collector)
    return collector
