"""Prometheus metrics of the control plane, in vLLM's registry (so they appear on the HTTP
server's `/metrics`).

Runs in the `enginectl serve` process; counters are thread-safe, and gauges read the ledger
at scrape time, so nothing is computed on the RPC path but one counter increment.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from enginectl.server.ledger import WeightVersionLedger


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

    def rpc_done(self, rpc: str, code: str) -> None:
        self.rpcs.labels(rpc=rpc, code=code).inc()
