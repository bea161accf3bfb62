"""Prometheus metrics of the control plane, in vLLM's registry (so they appear on the HTTP
server's `/metrics`).

Runs in the `enginectl serve` process; counters are thread-safe, and gauges read the ledger
at scrape time, so nothing is computed on the RPC path but one counter increment.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from enginectl.server.fpm.relay import FpmRelay
from enginectl.server.weights.ledger import WeightVersionLedger


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
            "Weight updates finished, by source (disk, distributed, tensors) and result "
            "(ok, failed: nothing written, partial: failed after writing began).",
            ["source", "result"],
            registry=registry,
        )
        self.update_bytes = Counter(
            "enginectl_weight_update_bytes",
            "Tensor bytes loaded by successful weight updates (per rank, summed).",
            registry=registry,
        )

    def update_done(self, source: str, result: str, nbytes: int) -> None:
        self.updates.labels(source=source, result=result).inc()
        if nbytes:
            self.update_bytes.inc(nbytes)

    def rpc_done(self, rpc: str, code: str) -> None:
        self.rpcs.labels(rpc=rpc, code=code).inc()


class FpmRelayCollector:
    """The FPM relay's counters, read from `FpmRelay.stats` at scrape time (the relay only
    increments plain integers on its hot path)."""

    def __init__(self, relay: FpmRelay) -> None:
        self._relay = relay

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._relay.stats
        relayed = CounterMetricFamily(
            "enginectl_fpm_samples_relayed", "Forward-pass metrics samples the relay sequenced and fanned out."
        )
        relayed.add_metric([], stats.accepted)
        dropped = CounterMetricFamily(
            "enginectl_fpm_samples_dropped",
            "Samples dropped at the relay, by reason: unattributed (empty worker_id while "
            "--await-worker-id requires one) or malformed.",
            labels=["reason"],
        )
        dropped.add_metric(["unattributed"], stats.dropped_unattributed)
        dropped.add_metric(["malformed"], stats.dropped_malformed)
        missed = CounterMetricFamily(
            "enginectl_fpm_subscriber_missed",
            "Samples coalesced away from slow stream subscribers' queues (summed over subscribers).",
        )
        missed.add_metric([], stats.subscriber_missed)
        yield from (relayed, dropped, missed)


def register_fpm_metrics(relay: FpmRelay, registry: CollectorRegistry = REGISTRY) -> FpmRelayCollector:
    """Export the relay's counters in `registry` (once per process)."""
    collector = FpmRelayCollector(relay)
    registry.register(collector)
    return collector
