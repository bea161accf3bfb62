"""latest.md of the recovery soak (bench/recovery/run.py), from its results."""

from __future__ import annotations

from typing import Any


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def markdown(r: dict[str, Any]) -> str:
    m, c = r["machine"], r["config"]
    dirty = " + uncommitted changes" if r["repo"]["dirty"] else ""
    lines = [
        f"# enginectl recovery soak — {m['date']}",
        "",
        (
            f"{r['rounds_run']} rounds (of at most {c['rounds']} within {c['duration_s']:.0f} s) in "
            f"{r.get('rounds_s', 0):.0f} s, {r['elapsed_s']:.0f} s in all, on one `enginectl serve` (embedded tiny "
            f"model, {r.get('checkpoints', {}).get('tensors', '?')} tensors); {m['nproc']} cores, load avg "
            f"{m['loadavg_start']}; vLLM {m['vllm']}; commit {r['repo']['commit']}{dirty}; seed {c['seed']}. "
            f"Result: **{'PASSED' if r['passed'] else 'FAILED'}**"
            + ("." if r["passed"] else f" ({'; '.join(r['failures'])}).")
        ),
        "",
        f"**Mismatches after a recovery: {r.get('mismatch_count', 'n/a')}** (must be 0).",
        "",
    ]
    partials = r.get("partials", {})
    if partials:
        lines += [
            "| partial update via | PARTIAL_UPDATE | refused (nothing written) | completed (break too late) |",
            "|---|---|---|---|",
        ]
        lines += [f"| {s} | {p['partial']} | {p['refused']} | {p['completed']} |" for s, p in partials.items()]
        lines += ["", f"- causes: {_counts(r.get('causes', {}))}"]
        lines.append(
            f"- partial updates of NaN weights (`--nan-partials` {c.get('nan_partials')}), by outcome: "
            f"{_counts(r.get('poisoned_partials', {}))}"
        )
        lines.append(
            f"- forced resumes over mixed weights: {r.get('forced_resumes', 0)}, of which "
            f"{r.get('nan_generations', 0)} generated all token 0 (NaN logits: KV-cache blocks written with NaN)"
        )
        lines.append(f"- recoveries checked, by source: {_counts(r.get('recoveries_checked', {}))}")
        lines.append(f"- recoveries that failed: {_counts(r.get('recoveries_failed', {}))}")
    ro = r.get("rollouts", {})
    lines.append(
        f"- rollouts ({ro.get('threads', 0)} threads): {ro.get('completed', 0)} completed of {ro.get('requests', 0)}, "
        f"{ro.get('output_tokens', 0)} tokens; {ro.get('all_zero_outputs', 0)} outputs all token 0 "
        f"({ro.get('all_zero_while_trusted', 0)} while trusted, of which **{ro.get('poisoned_count', 0)} poisoned**: "
        "not repeated by the same request); "
        f"errors {_counts(ro.get('errors', {}))}"
    )
    refs = r.get("references")
    if refs:
        lines += [
            "",
            f"References (fresh server; prompts of {refs['prompt_lengths']} ids, 8 greedy tokens; {refs['method']}):",
            "",
        ]
        for which in ("A", "B"):
            lines.append(f"- {which}: tokens {refs[which]['tokens']}; rank digests {refs[which]['rank_digests']}")
    for key, title in (
        ("mismatches", "Mismatches"),
        ("anomalies", "States contradicting an outcome"),
        ("errors", "Unexpected errors"),
    ):
        if r.get(key):
            lines += ["", f"{title}:", ""]
            lines += [f"- {item}" for item in r[key]]
    if "crash" in r:
        lines += ["", f"Crashed: {r['crash']}"]
    return "\n".join(lines) + "\n"
