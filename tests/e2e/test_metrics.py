"""enginectl's Prometheus metrics (server/metrics.py, docs/metrics.md), end to end.

The pure-code checks (every update result and pause reason, against in-memory engines) are in
tests/unit/test_metrics.py. Here, on the session's `weights_server` (tests/e2e/conftest.py): a disk
update, a PauseGeneration/ResumeGeneration, an FPM stream and identity syncs, read back by
scraping vLLM's `/metrics` over HTTP and parsing it with prometheus_client's parser. Last,
the Grafana dashboard (examples/grafana/) and docs/metrics.md name only metrics the server
exports, and docs/metrics.md names all of them.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serving import ServeProcess
from support.weight_updates import Stubs
from support.weights import Checkpoints

from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_svc
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc
from enginectl.weights.v1 import weight_update_service_pb2 as upb

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "enginectl-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
UPDATE_SECONDS = "enginectl_weight_update_duration_seconds"
PAUSE_SECONDS = "enginectl_generation_pause_seconds"
PAUSE_RPC = "/enginectl.weights.v1.WeightUpdateService/PauseGeneration"
Labels = frozenset[tuple[str, str]]


# --- end to end: the session's weights_server, scraped over HTTP ---------------------------


class Scrape:
    """One scrape of a server's /metrics: every sample by (name, labels); enginectl families."""

    def __init__(self, server: ServeProcess) -> None:
        with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as response:
            text = response.read().decode()
        self.samples: dict[tuple[str, Labels], float] = {}
        self.families: dict[str, str] = {}  # enginectl family -> type
        for family in text_string_to_metric_families(text):
            # prometheus_client adds a `<name>_created` timestamp to counters and histograms.
            if family.name.startswith("enginectl_") and not family.name.endswith("_created"):
                self.families[family.name] = family.type
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"{name}{labels} is not on /metrics"
        return self.samples[key]

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def buckets(self, name: str, **labels: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound."""
        wanted = set(labels.items())
        return {
            float(dict(key)["le"]): value
            for (sample, key), value in self.samples.items()
            if sample == f"{name}_bucket" and wanted <= set(key)
        }


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    """How far a sample moved between two scrapes (from 0 if it appeared meanwhile)."""
    return after(name, **labels) - (before.get(name, **labels) or 0.0)


def test_a_disk_update_is_timed_counted_and_its_bytes_and_pause_recorded(
    weights_server: ServeProcess, stubs: Stubs, checkpoints: Checkpoints
) -> None:
    assert not stubs.state().paused  # so the update pauses generation itself
    before = Scrape(weights_server)
    response = stubs.load(checkpoints.a, "A")  # the weights it serves: the server stays as it was
    after = Scrape(weights_server)

    ok = {"source": "disk", "result": "ok"}
    assert moved(before, after, "enginectl_weight_updates_total", **ok) == 1
    assert moved(before, after, f"{UPDATE_SECONDS}_count", **ok) == 1
    assert moved(before, after, f"{UPDATE_SECONDS}_sum", **ok) > 0
    # The one observation went into every bucket from some bound up, none below it.
    grew = [
        after.buckets(UPDATE_SECONDS, **ok)[le] - n for le, n in sorted(before.buckets(UPDATE_SECONDS, **ok).items())
    ]
    assert grew[-1] == 1 and grew == sorted(grew) and set(grew) <= {0, 1}
    for result in ("failed", "partial", "cancelled"):
        assert moved(before, after, f"{UPDATE_SECONDS}_count", source="disk", result=result) == 0
    loaded = sum(rank.bytes_loaded for rank in response.ranks)
    assert loaded > 0
    assert moved(before, after, "enginectl_weight_update_bytes_total", source="disk") == loaded
    assert moved(before, after, "enginectl_weight_update_bytes_total", source="tensors") == 0

    assert response.generation_resumed
    assert moved(before, after, f"{PAUSE_SECONDS}_count", reason="update") == 1
    assert moved(before, after, f"{PAUSE_SECONDS}_count", reason="caller") == 0
    assert after("enginectl_generation_paused") == 0
    assert moved(before, after, "enginectl_weight_version_revision") == 1
    assert after("enginectl_weight_version_declared") == 1
    assert after("enginectl_weight_staged_bytes") == 0


@pytest.fixture
def resumed_after(stubs: Stubs) -> Iterator[Stubs]:
    yield stubs
    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest(force=True))


def test_a_callers_pause_is_seen_while_it_lasts_and_timed_at_resume(
    weights_server: ServeProcess, resumed_after: Stubs
) -> None:
    stubs = resumed_after
    assert not stubs.state().paused
    before = Scrape(weights_server)
    stubs.updates.PauseGeneration(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    paused = Scrape(weights_server)
    assert paused("enginectl_generation_paused") == 1
    assert moved(before, paused, f"{PAUSE_SECONDS}_count", reason="caller") == 0  # not over yet
    assert moved(before, paused, "enginectl_rpcs_total", rpc=PAUSE_RPC, code="OK") == 1

    stubs.updates.ResumeGeneration(upb.ResumeGenerationRequest())
    after = Scrape(weights_server)
    assert after("enginectl_generation_paused") == 0
    assert moved(before, after, f"{PAUSE_SECONDS}_count", reason="caller") == 1
    assert moved(before, after, f"{PAUSE_SECONDS}_sum", reason="caller") > 0
    assert moved(before, after, f"{PAUSE_SECONDS}_count", reason="update") == 0


def test_fpm_subscribers_and_the_newest_samples_age(weights_server: ServeProcess, stubs: Stubs) -> None:
    before = Scrape(weights_server)
    stream = fpm_grpc.ForwardPassMetricsServiceStub(stubs.channel).StreamForwardPassMetrics(
        fpm_svc.StreamForwardPassMetricsRequest(include_heartbeats=True), timeout=60
    )
    try:
        # The first message is progress (subscribed); then heartbeats arrive every second.
        messages = iter(stream)
        assert next(messages).HasField("progress")
        while not next(messages).HasField("batch"):
            pass
        during = Scrape(weights_server)
    finally:
        stream.cancel()
    assert moved(before, during, "enginectl_fpm_subscribers") == 1
    assert during("enginectl_fpm_newest_sample_age_seconds") >= 0
    assert during("enginectl_fpm_subscriber_backlog") >= 0
    assert during("enginectl_fpm_samples_relayed_total") >= 1


def test_identity_syncs_are_counted(weights_server: ServeProcess, stubs: Stubs) -> None:
    identity = id_grpc.FpmIdentityServiceStub(stubs.channel)
    request = id_pb2.SetWorkerIdentityRequest(worker_id=f"metrics-{uuid.uuid4().hex[:8]}")
    before = Scrape(weights_server)
    identity.SetWorkerIdentity(request, timeout=60)
    identity.SetWorkerIdentity(request, timeout=60)  # a safe retry: every rank holds it
    after = Scrape(weights_server)
    assert moved(before, after, "enginectl_fpm_identity_syncs_total", result="ok") == 1
    assert moved(before, after, "enginectl_fpm_identity_syncs_total", result="unchanged") == 1
    assert moved(before, after, "enginectl_fpm_identity_syncs_total", result="failed") == 0


# --- the dashboard and the docs name what the server exports -----------------------------


def exported_names(scrape: Scrape) -> set[str]:
    """Family names and the sample names they expose (`_total`, `_bucket`, `_count`, ...)."""
    return set(scrape.families) | {name for name, _ in scrape.samples if name.startswith("enginectl_")}


def test_the_dashboard_queries_only_exported_metrics(weights_server: ServeProcess) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert queries and all(
        p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"] if p["type"] != "row"
    )
    used = {name for q in queries for name in re.findall(r"enginectl_[a-z_]+", q)}
    missing = used - exported_names(Scrape(weights_server))
    assert not missing, f"the dashboard queries metrics the server does not export: {sorted(missing)}"
    # Every enginectl family has a panel.
    families = Scrape(weights_server).families
    unused = {f for f in families if not any(n == f or n.startswith(f + "_") for n in used)}
    assert not unused, f"no panel shows {sorted(unused)}"


def test_docs_list_every_exported_metric(weights_server: ServeProcess) -> None:
    scrape = Scrape(weights_server)
    documented = set(re.findall(r"`(enginectl_[a-z_]+)(?:\{[^`]*\})?`", METRICS_DOC.read_text()))
    shown = {name.removesuffix("_total") for name in documented}
    undocumented = {f for f in scrape.families if f not in shown}
    assert not undocumented, f"docs/metrics.md does not list {sorted(undocumented)}"
    assert documented <= exported_names(scrape), sorted(documented - exported_names(scrape))
