"""The soak's checks (bench/soak/run.py): lost writes, resource growth after warm-up within the bounds
below, and the pass/fail list a run ends with.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from bench.soak.records import MIB, Errors, Snapshot, Write
from enginectl.client import Reason, WeightVersion

# Growth bounds, per process, from the sample after warm-up to the one at the end (both under
# the same load and both taken between two updates, so no update's transient buffers, gloo
# group or stream is counted). By the end of warm-up the engine has compiled, its caches are
# in use, the thread pools have grown, and the vLLM worker process has made the climb its RSS
# makes over its first few hundred updates (hundreds of MiB, flat afterwards: allocator arenas
# and the CPU backend's repacked weights; bench/README.md's soak section has the recorded
# run's; a 20% warm-up of the default 10 minutes covers it, runs under ~5 minutes need
# `--warmup 0.5`). What is left is allocator noise, which moves a ~600 MB Python process by
# tens of MiB, and bounded structures still filling (the FPM ring of 10,000 samples, the
# ledger's 10,000 remembered request ids: ~20 MB at most). A leak per update is caught either
# way: one copy of the tiny model's weights (~1.8 MB) kept per update exceeds 64 MiB within
# ~35 of the thousands of updates a default run makes; one socket or thread kept per update
# (e.g. per gloo group) exceeds +16 fds / +8 threads within a few rotations. Thread pools that
# grow on demand (asyncio's default executor: cpu_count + 4) are why threads get some slack.
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_FLOOR = 64 * MIB
FD_GROWTH = 16
THREAD_GROWTH = 8


# -- verification ------------------------------------------------------------------------------
def verify_writes(writes: list[Write], states: list[WeightVersion]) -> dict[str, Any]:
    """Every acknowledged write must appear exactly once among the watched declared states,
    under its revision and version, and the watched revisions must be consecutive."""
    declared = [s for s in states if s.declared]
    by_revision: dict[int, list[str]] = {}
    for s in declared:
        by_revision.setdefault(s.revision, []).append(s.version or "")
    missing = [w for w in writes if by_revision.get(w.revision, []).count(w.version) != 1]
    duplicated = sorted(r for r, vs in by_revision.items() if len(vs) > 1)
    revisions = sorted(by_revision)
    gaps = (revisions[-1] - revisions[0] + 1 - len(revisions)) if revisions else 0
    acked = {(w.revision, w.version) for w in writes}
    unacknowledged = [r for r, vs in by_revision.items() for v in vs if (r, v) not in acked]
    return {
        "acknowledged_writes": len(writes),
        "by_kind": dict(Counter(w.kind for w in writes)),
        "watched_states": len(states),
        "watched_declared": len(declared),
        "first_revision": revisions[0] if revisions else None,
        "last_revision": revisions[-1] if revisions else None,
        "missing": len(missing),
        "missing_examples": [asdict(w) for w in missing[:5]],
        "duplicated_revisions": len(duplicated),
        "revision_gaps": gaps,
        "unacknowledged": len(unacknowledged),  # watched but never acknowledged (e.g. a lost reply)
        "lost_writes": len(missing) + len(duplicated) + gaps,
    }


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None with fewer than 3."""
    if len(points) < 3:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def growth(before: Snapshot, after: Snapshot, series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process present in both: growth, whether it is within the bounds above, and the RSS
    trend over the series samples between them (MiB per minute, over all of them and over the
    last half: a trend that flattens is a cache filling, one that does not is a leak)."""
    prev = {p["pid"]: p for p in before.processes}
    rows = []
    for p in after.processes:
        b = prev.get(p["pid"])
        if b is None:
            continue
        rss = (p["rss_mib"] - b["rss_mib"]) * MIB
        rss_bound = max(RSS_GROWTH_FLOOR, RSS_GROWTH_FRACTION * b["rss_mib"] * MIB)
        key = f"{p['role']} {p['pid']}"
        trend = [
            (s["t_s"] / 60, s["rss_mib"][key])
            for s in series
            if before.t_s <= s["t_s"] <= after.t_s and key in s["rss_mib"]
        ]
        whole, last = slope(trend), slope(trend[len(trend) // 2 :])
        updates = after.updates - before.updates
        rows.append(
            {
                "pid": p["pid"],
                "role": p["role"],
                "rss_mib": round(rss / MIB, 1),
                "rss_bound_mib": round(rss_bound / MIB, 1),
                "fds": p["fds"] - b["fds"],
                "threads": p["threads"] - b["threads"],
                "rss_mib_per_min": None if whole is None else round(whole, 2),
                "rss_mib_per_min_last_half": None if last is None else round(last, 2),
                "rss_kib_per_update": round(rss / 1024 / updates, 1) if updates else None,
                "ok": rss <= rss_bound
                and p["fds"] - b["fds"] <= FD_GROWTH
                and p["threads"] - b["threads"] <= THREAD_GROWTH,
            }
        )
    return rows


def check(name: str, value: Any, bound: str, ok: bool, detail: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "bound": bound, "ok": ok, "detail": detail}


def checks(
    r: dict[str, Any],
    errors: Errors,
    deaths: list[str],
    snapshots: dict[str, Snapshot],
    series: list[dict[str, Any]],
    sources: tuple[str, ...],
) -> list[dict[str, Any]]:
    """Every check of a run, given its results `r` and what the run recorded (bench/soak/run.py)."""
    dead = sum(n for k, n in errors.counts.items() if Reason.ENGINE_DEAD in k)
    out: list[dict[str, Any]] = [
        check("soak ran to its end", r.get("crash", "yes"), "no exception", "crash" not in r),
        check(
            "engine alive",
            "died: " + "; ".join(deaths) if deaths else "yes",
            "alive to the end",
            not deaths and not dead,
            f"{dead} ENGINE_DEAD answers" if dead else "",
        ),
    ]
    warm, end = snapshots.get("after_warmup"), snapshots.get("end")
    if warm is not None and end is not None:
        rows = growth(warm, end, series)
        bad = [g for g in rows if not g["ok"]]
        out.append(
            check(
                "resource growth after warm-up",
                rows,
                f"per process: RSS <= max({RSS_GROWTH_FLOOR // MIB} MiB, "
                f"{RSS_GROWTH_FRACTION:.0%}), fds <= +{FD_GROWTH}, threads <= +{THREAD_GROWTH}",
                not bad,
                "; ".join(
                    f"{g['role']} pid {g['pid']}: RSS {g['rss_mib']:+} MiB, fds {g['fds']:+}, threads {g['threads']:+}"
                    for g in bad
                ),
            )
        )
        gone = {p["pid"] for p in warm.processes} - {p["pid"] for p in end.processes}
        new = {p["pid"]: p["role"] for p in end.processes if p["pid"] not in {q["pid"] for q in warm.processes}}
        out.append(
            check(
                "server processes after warm-up",
                {"gone": sorted(gone), "new": new},
                "the same processes",
                not gone and not new,
            )
        )
    else:
        out.append(
            check(
                "resource growth after warm-up",
                None,
                "samples after warm-up and at the end",
                False,
                "the run ended before both samples were taken",
            )
        )
    w: dict[str, Any] = r.get("writes") or {}
    out.append(
        check(
            "lost writes",
            w.get("lost_writes"),
            "0",
            w.get("lost_writes") == 0 and bool(r.get("watch_caught_up")),
            "" if r.get("watch_caught_up") else "the watcher never saw the final state",
        )
    )
    churn = r.get("watch", {}).get("churn", {})
    out.append(check("Watch resume gaps", churn.get("declared_gaps"), "0", churn.get("declared_gaps") == 0))
    fpm = r.get("fpm", [])
    gaps = sum(s["unreported_gap_samples"] + s["out_of_order"] for s in fpm)
    out.append(
        check(
            "FPM gaps not reported as missed",
            gaps,
            "0",
            bool(fpm) and gaps == 0,
            "; ".join(
                f"{s['name']}: {s['unreported_gap_events']} jumps, {s['out_of_order']} out of order"
                for s in fpm
                if s["unreported_gap_samples"] or s["out_of_order"]
            ),
        )
    )
    other = sum(s["other_worker"] + s["incarnation_changes"] for s in fpm)
    out.append(check("FPM identity and incarnation", other, "0", other == 0))
    internal = errors.internal()
    out.append(check("UNKNOWN/INTERNAL statuses (and HTTP 5xx)", internal, "0", internal == 0))
    unexpected = errors.total()
    out.append(
        check(
            "unexpected errors (any status but CAS ETAG_MISMATCH)",
            unexpected,
            "0",
            unexpected == 0,
            "; ".join(f"{k}: {n}" for k, n in errors.counts.items()),
        )
    )
    ro = r.get("rollouts", {})
    stale = ro.get("unknown_versions", [])
    out.append(check("rollout versions never declared", len(stale), "0", not stale, ", ".join(stale[:5])))
    up = r.get("updates", {})
    every = all(up.get("ok", {}).get(s, 0) > 0 for s in sources) and ro.get("completed", 0) > 0
    out.append(check("every source updated, rollouts completed", up.get("ok"), ">= 1 each", every))
    drift = {k: n for k, n in up.get("verify", {}).items() if k != "MATCH"}
    out.append(check("VerifyWeights after updates", up.get("verify"), "MATCH", not drift))
    stuck = r.get("stuck_threads", [])
    out.append(check("load loops stopped", stuck, "none left running", not stuck))
    stop = r.get("server_stop", {})
    out.append(
        check(
            "server stop",
            {k: stop.get(k) for k in ("exit_code", "children_left")},
            "exit 0, no child left",
            stop.get("exit_code") == 0 and not stop.get("children_left"),
        )
    )
    return out
