"""The soak's results and report (bench/soak/run.py): summaries of the load for latest.json, and
latest.md.
"""

from __future__ import annotations

from typing import Any

from bench.lib.stats import summarize_ms
from bench.soak.load import RolloutStats, UpdateStats
from bench.soak.records import SOURCES, VLLM_PLACEHOLDER


def rollout_summary(st: RolloutStats, warmup: float) -> dict[str, Any]:
    lat = st.latencies
    return {
        "requests": st.requests,
        "completed": st.completed,
        "prompt_tokens": st.prompt_tokens,
        "output_tokens": st.output_tokens,
        "unstamped": st.unstamped,
        "multi_version": st.multi_version,
        "placeholder": st.placeholder,
        "versions_seen": len(st.versions),
        "latency_warmup": summarize_ms([s for t, s in lat if t < warmup]),
        "latency_after_warmup": summarize_ms([s for t, s in lat if t >= warmup]),
    }


def update_summary(st: UpdateStats) -> dict[str, Any]:
    return {
        "ok": dict(st.ok),
        "failed": dict(st.failed),
        "declarations": st.declarations,
        "declarations_failed": st.declarations_failed,
        "verify": dict(st.verify),
        "wall": {s: summarize_ms(v) for s, v in st.wall_s.items()},
        "server": {s: summarize_ms(v) for s, v in st.server_s.items()},
    }


# -- report ------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def markdown(r: dict[str, Any]) -> str:
    m, c = r["machine"], r["config"]
    weights_mb = r.get("checkpoints", {}).get("bytes", 0) / 1e6
    dirty = " + uncommitted changes" if r["repo"]["dirty"] else ""
    lines = [
        f"# enginectl soak — {m['date']}",
        "",
        (
            f"{c['duration_s']:.0f} s of load ({c['warmup_s']:.0f} s warm-up) on one `enginectl serve` (embedded "
            f"tiny model, {weights_mb:.1f} MB of weights); {m['nproc']} cores, load avg {m['loadavg_start']} -> "
            f"{m.get('loadavg_end')}; vLLM {m['vllm']}; commit {r['repo']['commit']}{dirty}. "
            f"Result: **{'PASSED' if r['passed'] else 'FAILED'}**."
        ),
        "",
        "| check | value | bound | ok |",
        "|---|---|---|---|",
    ]
    for ch in r["checks"]:
        value, detail = ch["value"], f" ({ch['detail']})" if ch["detail"] else ""
        if ch["name"] == "resource growth after warm-up" and isinstance(value, list):
            value = "; ".join(
                f"{g['role']}: RSS {g['rss_mib']:+} MiB ({g['rss_mib_per_min']} MiB/min, last half "
                f"{g['rss_mib_per_min_last_half']}), fds {g['fds']:+}, threads {g['threads']:+}"
                for g in value
            )
            detail = ""
        lines.append(f"| {ch['name']} | {value}{detail} | {ch['bound']} | {'yes' if ch['ok'] else '**no**'} |")

    snaps = r.get("snapshots", {})
    labels = [k for k in ("start", "after_warmup", "end", "idle_end") if k in snaps]
    if labels:
        lines += ["", "Resources (RSS MiB / open fds / threads; `end` under load, `idle_end` after it stopped):", ""]
        lines.append("| process | " + " | ".join(f"{k} (t={snaps[k]['t_s']:.0f}s)" for k in labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
        names: dict[int, str] = {}
        for k in labels:
            for p in snaps[k]["processes"]:
                names.setdefault(p["pid"], f"{p['role']} ({p['pid']})")
        for pid, name in names.items():
            cells = []
            for k in labels:
                row = next((p for p in snaps[k]["processes"] if p["pid"] == pid), None)
                cells.append(f"{row['rss_mib']} / {row['fds']} / {row['threads']}" if row else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

    ro, up, cas, w = r.get("rollouts"), r.get("updates"), r.get("cas"), r.get("writes")
    if ro and up and cas and w:
        lat, churn = ro["latency_after_warmup"], r["watch"]["churn"]
        updates = ", ".join(
            f"{s} {up['ok'].get(s, 0)} ok / {up['failed'].get(s, 0)} failed (p50 {_ms(up['wall'][s].get('p50_ms'))} ms)"
            for s in SOURCES
            if s in up["ok"] or s in up["failed"]
        )
        lines += ["", "Activity:", ""]
        lines.append(
            f"- rollouts: {ro['completed']} completed of {ro['requests']} ({ro['prompt_tokens']} prompt / "
            f"{ro['output_tokens']} output tokens; {ro['multi_version']} generated across an update; "
            f"latency after warm-up p50 {_ms(lat.get('p50_ms'))} ms, p99 {_ms(lat.get('p99_ms'))} ms; "
            f"{ro['placeholder']} stamped `{VLLM_PLACEHOLDER}`, generated before the first declaration)"
        )
        lines.append(f"- weight updates: {updates}; declarations {up['declarations']}; VerifyWeights {up['verify']}")
        lines.append(
            f"- CAS writers: {cas['rounds']} rounds, {cas['succeeded']} succeeded, {cas['etag_mismatch']} ETAG_MISMATCH"
        )
        lines.append(
            f"- watched: {w['watched_declared']} declared states, revisions {w['first_revision']}.."
            f"{w['last_revision']}; {w['acknowledged_writes']} acknowledged writes {w['by_kind']}; "
            f"lost {w['lost_writes']} (missing {w['missing']}, duplicated {w['duplicated_revisions']}, "
            f"gaps {w['revision_gaps']}); unacknowledged {w['unacknowledged']}"
        )
        lines.append(
            f"- Watch churn: {churn['connects']} connects, {churn['states']} states, "
            f"{churn['declared_gaps']} gaps, {churn['resyncs']} re-syncs"
        )
        for s in r.get("fpm", []):
            lines.append(
                f"- {s['name']}: {s['connects']} connects ({s['resumes']} resumes), {s['samples']} "
                f"samples ({s['heartbeats']} heartbeats), {s.get('stalls', 0)} stalls, missed "
                f"{s['missed_reported']} (reported), unreported gaps {s['unreported_gap_samples']}, "
                f"evicted {s['evicted']}"
            )
    if r.get("errors", {}).get("counts"):
        lines += ["", "Errors:", ""]
        lines += [f"- {k}: {n} (e.g. {r['errors']['examples'].get(k, '')!r})" for k, n in r["errors"]["counts"].items()]
    return "\n".join(lines) + "\n"
