"""enginectl's Prometheus metrics (server/metrics.py, docs/metrics.md).

First as pure code: WeightUpdates and IdentitySync against in-memory engines
(tests/engine_double.py), reporting into a private registry, drive every update result and
every pause reason. Then end to end on the session's `weights_server` (conftest.py): a disk
update, a PauseGeneration/ResumeGeneration, an FPM stream and identity syncs, read back by
scraping vLLM's `/metrics` over HTTP and parsing it with prometheus_client's parser. Last,
the Grafana dashboard (examples/grafana/) and docs/metrics.md name only metrics the server
exports, and docs/metrics.md names all of them.
"""

from __future__ import annotations

# ruff: noqa: F811 (the `stubs` fixture imported from weight_update_fixtures is a parameter here)
import asyncio
import json
import re
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support.engine_double import EngineDouble, LoadScript
from support.serving import ServeProcess
from support.weight_updates import Stubs, stubs  # noqa: F401
from support.weights import Checkpoints

from enginectl.common.vocabulary import WeightSource
from enginectl.contract.engine import Cause, RankFailure, RankIdentity
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2 as fpm_svc
from enginectl.fpm.v1 import forward_pass_metrics_service_pb2_grpc as fpm_grpc
from enginectl.fpm.v1 import fpm_identity_service_pb2 as id_pb2
from enginectl.fpm.v1 import fpm_identity_service_pb2_grpc as id_grpc
from enginectl.server.engine import RankOutcome
from enginectl.server.errors import ControlPlaneError
from enginectl.server.fpm.identity import IdentitySync
from enginectl.server.metrics import ControlPlaneMetrics
from enginectl.server.weights.disk import TensorInfo
from enginectl.server.weights.ledger import WeightVersionLedger
from enginectl.server.weights.operations import OperationStore, UpdateOperation
from enginectl.server.weights.plans import UpdatePlan
from enginectl.server.weights.updates import WeightUpdates
from enginectl.weights.v1 import weight_update_service_pb2 as upb

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "enginectl-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
WAIT_S = 10.0
TENSOR = TensorInfo("w", "float32", (2, 2))
UPDATE_SECONDS = "enginectl_weight_update_duration_seconds"
PAUSE_SECONDS = "enginectl_generation_pause_seconds"
PAUSE_RPC = "/enginectl.weights.v1.WeightUpdateService/PauseGeneration"
Labels = frozenset[tuple[str, str]]


# --- pure: WeightUpdates and IdentitySync against in-memory engines ----------------------


class Registry:
    """A private registry the metrics report into, read back by sample name and labels."""

    def __init__(self, ledger: WeightVersionLedger) -> None:
        self.registry = CollectorRegistry()
        self.metrics = ControlPlaneMetrics(ledger, registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        assert value is not None, f"{name}{labels} is not exported"
        return value


@pytest.fixture
async def engine() -> EngineDouble:
    return EngineDouble()


@pytest.fixture
async def ledger(engine: EngineDouble) -> WeightVersionLedger:
    return WeightVersionLedger(publish=engine.set_weight_version)


@pytest.fixture
async def exported(ledger: WeightVersionLedger) -> Registry:
    return Registry(ledger)


@pytest.fixture
async def updates(
    engine: EngineDouble, ledger: WeightVersionLedger, exported: Registry
) -> AsyncIterator[WeightUpdates]:
    metrics = exported.metrics
    updates = WeightUpdates(
        engine,
        ledger,
        OperationStore(),
        allowed_roots=[],
        expected={TENSOR.name: TENSOR},
        on_finished=metrics.update_done,
        on_pause=metrics.pause_changed,
    )
    await updates.prepare()
    yield updates
    updates.close()


def plan() -> UpdatePlan:
    return UpdatePlan(WeightSource.TENSORS, [TENSOR], [], "", "v1", "", "", "keep", True, 30.0)


async def finished(updates: WeightUpdates, op: UpdateOperation) -> None:
    await asyncio.wait_for(updates.operations.wait(op, None), WAIT_S)
    assert op.done


async def cancelled_before_loading(updates: WeightUpdates, engine: EngineDouble) -> None:
    """CancelOperation while the update pauses generation (as test_update_state_machine.py)."""
    gate = asyncio.Event()
    original = engine.pause

    async def slow_pause(mode: str, clear_cache: bool) -> None:
        await gate.wait()
        await original(mode, clear_cache)

    engine.pause = slow_pause  # type: ignore[method-assign]
    op, _ = await updates.start(plan())
    op.cancel()
    gate.set()
    await finished(updates, op)
    engine.pause = original  # type: ignore[method-assign]


async def test_every_update_result_is_counted_and_timed_once(
    updates: WeightUpdates, engine: EngineDouble, exported: Registry
) -> None:
    script = [  # ok, failed (nothing written), partial (written, then failed)
        LoadScript(),
        LoadScript(error=Cause.UPDATE_TIMEOUT, modified=False),
        LoadScript(error=Cause.STREAM_BROKEN, modified=True),
    ]
    for load in script:
        engine.script = load
        op, _ = await updates.start(plan())
        await finished(updates, op)
        await updates.resume(upb.ResumeGenerationRequest(force=True))  # after the partial one
    await cancelled_before_loading(updates, engine)
    assert engine.calls.count("load") == 3  # the cancelled one loaded nothing

    for result in ("ok", "failed", "partial", "cancelled"):
        labels = {"source": "tensors", "result": result}
        assert exported.value("enginectl_weight_updates_total", **labels) == 1, result
        assert exported.value(f"{UPDATE_SECONDS}_count", **labels) == 1, result
        assert exported.value(f"{UPDATE_SECONDS}_bucket", **labels, le="+Inf") == 1, result
    for source in ("disk", "distributed"):  # every series exists from the start, at 0
        assert exported.value("enginectl_weight_updates_total", source=source, result="ok") == 0
        assert exported.value("enginectl_weight_update_bytes_total", source=source) == 0
    assert exported.value("enginectl_weight_staged_bytes") == 0


async def test_pauses_are_timed_by_who_paused_from_pause_to_resume(
    updates: WeightUpdates, engine: EngineDouble, exported: Registry
) -> None:
    def pauses(reason: str) -> float:
        return exported.value(f"{PAUSE_SECONDS}_count", reason=reason)

    assert exported.value("enginectl_generation_paused") == 0
    # A caller's pause lasts until its resume.
    await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))
    assert exported.value("enginectl_generation_paused") == 1
    await updates.pause(upb.PauseGenerationRequest(mode=upb.PAUSE_MODE_KEEP))  # still the same pause
    assert pauses("caller") == 0
    await updates.resume(upb.ResumeGenerationRequest())
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 0, 0)

    # An update's pause ends when the update resumes generation.
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 1, 0)

    # A partial update holds its pause until a forced resume: one pause, the update's.
    engine.script = LoadScript(error=Cause.LOAD_FAILED, modified=True)
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("update"), exported.value("enginectl_generation_paused")) == (1, 1)
    await updates.resume(upb.ResumeGenerationRequest(force=True))
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 2, 0)

    # A pause made by someone else (vLLM's own API) is not enginectl's: the update neither
    # pauses nor resumes, and nothing is timed.
    engine.script = LoadScript()
    engine.paused = True
    op, _ = await updates.start(plan())
    await finished(updates, op)
    assert (pauses("caller"), pauses("update"), exported.value("enginectl_generation_paused")) == (1, 2, 0)
    assert exported.value(f"{PAUSE_SECONDS}_bucket", reason="update", le="+Inf") == 2


class IdentityEngineDouble:
    """One rank; `fail` makes it refuse to set an identity."""

    def __init__(self) -> None:
        self.held = RankIdentity(0, "", 0)
        self.fail = False

    async def get_worker_identity(self, timeout: float) -> list[RankOutcome[RankIdentity]]:
        return [RankOutcome(0, self.held)]

    async def set_worker_identity(
        self, worker_id: str, generation: int, timeout: float
    ) -> list[RankOutcome[RankIdentity]]:
        if self.fail:
            return [RankOutcome(0, None, RankFailure.RANK_ERROR, "scripted failure")]
        self.held = RankIdentity(0, worker_id, generation)
        return [RankOutcome(0, self.held)]


async def test_identity_syncs_are_counted_by_result(exported: Registry) -> None:
    engine = IdentityEngineDouble()
    sync = IdentitySync(engine, on_synced=exported.metrics.identity_synced)
    await sync.set("worker-a", 5.0)
    await sync.set("worker-a", 5.0)  # every rank holds it already
    engine.fail = True
    with pytest.raises(ControlPlaneError):
        await sync.set("worker-b", 5.0)
    counts = {r: exported.value("enginectl_fpm_identity_syncs_total", result=r) for r in ("ok", "unchanged", "failed")}
    assert counts == {"ok": 1, "unchanged": 1, "failed": 1}


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
