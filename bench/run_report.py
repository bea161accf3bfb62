"""The figures of `python -m bench` (bench/run.py): each measured ratio against its target
(bench/README.md), and the markdown report written to latest.md.
"""

from __future__ import annotations

from bench.fleet import phase as fleet
from bench.fleet_hosts import phase as fleet_hosts
from bench.fpm import phase as fpm
from bench.fpm import publish as fpm_publish
from bench.gateway import phase as gateway
from bench.lib.stats import ratio, reported_figure
from bench.multinode import phase as multinode
from bench.rollouts import phase as rollouts_grpc
from bench.weights import load_check, tensor_parallel
from bench.weights import phase as weights

TARGETS = {  # bench/README.md, figures 1-3 and 7
    "latency_vs_bare": 1.15,  # enginectl p50 / bare grpc.aio p50 <=
    "latency_vs_http": 0.66,  # enginectl p50 / vLLM HTTP p50 <=
    "p99_under_rollouts": 3.0,  # loaded p99 / idle p99 <=
    "throughput_vs_bare": 0.85,  # enginectl req/s / bare req/s >=
    "grpc_rollout_tokens_per_s_vs_http": rollouts_grpc.TOKENS_PER_S_TARGET,  # gRPC Generate / HTTP >=
    "grpc_rollout_ttft_p50_vs_http": rollouts_grpc.TTFT_P50_TARGET,  # gRPC Generate / HTTP <=
}


# -- figures -------------------------------------------------------------------------------
def _figure(
    figure: str,
    baseline: str,
    base_val: float | None,
    eng_val: float | None,
    unit: str,
    target: float,
    higher_is_better: bool,
) -> dict:
    out = reported_figure(figure, baseline, base_val, eng_val, unit)
    r = out["ratio"]
    met = None if r is None else (r >= target if higher_is_better else r <= target)
    return {**out, "target": f"{'>=' if higher_is_better else '<='} {target}", "met": met}


def figures(results: dict) -> list[dict]:
    out = []
    lat = results.get("latency")
    if lat:
        t = lat["targets"]
        route = results["http_route"]
        out.append(
            _figure(
                "GetWeightVersion p50, 1 client, keep-alive",
                "bare grpc.aio unary p50",
                t["bare"].get("p50_ms"),
                t["enginectl"].get("p50_ms"),
                "ms",
                TARGETS["latency_vs_bare"],
                False,
            )
        )
        out.append(
            _figure(
                "GetWeightVersion p50, 1 client, keep-alive",
                f"vLLM HTTP GET {route} p50",
                t["http"].get("p50_ms"),
                t["enginectl"].get("p50_ms"),
                "ms",
                TARGETS["latency_vs_http"],
                False,
            )
        )
    if results.get("rollouts"):
        out.append(_p99_figure(results["rollouts"], "rollout streams"))
    tp = results.get("throughput")
    if tp:
        out.append(
            _figure(
                f"GetWeightVersion throughput, {tp['_config']['clients']} clients",
                "bare grpc.aio req/s",
                tp["bare"]["rps"],
                tp["enginectl"]["rps"],
                "req/s",
                TARGETS["throughput_vs_bare"],
                True,
            )
        )
    gr = results.get("grpc_rollouts")
    if gr:
        gen = gr["generate"]
        http, grpc = gen["http"], gen["grpc"]
        streams = f"{gen['_config']['streams']} streams x {gen['_config']['max_tokens']} tokens"
        out.append(
            _figure(
                f"gRPC Generate tokens/s, {streams}",
                "vLLM HTTP /v1/completions tokens/s",
                http["tokens_per_s"],
                grpc["tokens_per_s"],
                "tokens/s",
                TARGETS["grpc_rollout_tokens_per_s_vs_http"],
                True,
            )
        )
        out.append(
            _figure(
                f"gRPC Generate time to first token p50, {streams}",
                "vLLM HTTP /v1/completions TTFT p50",
                http["ttft"].get("p50_ms"),
                grpc["ttft"].get("p50_ms"),
                "ms",
                TARGETS["grpc_rollout_ttft_p50_vs_http"],
                False,
            )
        )
        out.append(_p99_figure(gr["p99"], "gRPC Generate rollout streams"))
    out += gateway.figures(results)
    out += fpm.figures(results)
    out += fpm_publish.figures(results)
    out += weights.figures(results)
    out += fleet.figures(results)
    out += tensor_parallel.figures(results)
    out += load_check.figures(results)
    out += multinode.figures(results)
    out += fleet_hosts.figures(results)
    return out


def _p99_figure(ro: dict, streams: str) -> dict:
    """GetWeightVersion p99 during rollouts (bench/run.py's phase_rollouts) vs idle."""
    return _figure(
        f"GetWeightVersion p99 during {ro['load']['streams']} {streams}",
        "same p99, idle",
        ro["idle"]["enginectl"].get("p99_ms"),
        ro["loaded"]["enginectl"].get("p99_ms"),
        "ms",
        TARGETS["p99_under_rollouts"],
        False,
    )


def _p99_table(ro: dict, what: str) -> list[str]:
    ld = ro["load"]
    lines = [
        "",
        f"p99 under {what} ({ld['streams']} streams x {ld['max_tokens']} tokens, "
        f"{ld['tokens_per_s']} tokens/s, {ld['completions']} completions; ms):",
        "",
        "| target | idle p50 | idle p99 | loaded p50 | loaded p99 | idle-after p99 | loaded/idle p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ro["loaded"]:
        i, lo, a = ro["idle"][name], ro["loaded"][name], ro["idle_after"][name]
        lines.append(
            f"| {name} | {i.get('p50_ms')} | {i.get('p99_ms')} | {lo.get('p50_ms')} | "
            f"{lo.get('p99_ms')} | {a.get('p99_ms')} | {ratio(lo.get('p99_ms'), i.get('p99_ms'))} |"
        )
    return lines


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f} {unit}" if unit in ("req/s", "samples/s", "tokens/s") else f"{v:.3f} {unit}"


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# enginectl bench ({results['mode']}) — {m['date']}",
        "",
        f"{m['nproc']} cores ({m['cpu_model']}), load avg at start {m['loadavg_start']}, "
        f"Python {m['python']}, grpcio {m['grpcio']}, vLLM {m['vllm']}. HTTP baseline route: "
        f"`{results['http_route']}`{' (VLLM_SERVER_DEV_MODE=1)' if results['http_route'] == '/weight_info' else ''}. "
        f"Commit {results['repo']['commit']}{' + uncommitted changes' if results['repo']['dirty'] else ''}.",
        "",
        "| figure | baseline | baseline value | enginectl | ratio | target | met? | physical floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in results["figures"]:
        met = "n/a" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(
            f"| {f['figure']} | {f['baseline']} | {_fmt(f['baseline_value'], f['unit'])} | "
            f"{_fmt(f['enginectl_value'], f['unit'])} | {f['ratio']} | {f['target']} | {met} | "
            f"{f.get('floor', '')} |"
        )
    lat = results.get("latency")
    if lat:
        lines += [
            "",
            "Latency, 1 client (interleaved blocks; ms):",
            "",
            "| target | n | p50 | p90 | p99 | p99.9 | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in lat["targets"].items():
            lines.append(
                f"| {name} | {s.get('n')} | {s.get('p50_ms')} | {s.get('p90_ms')} | {s.get('p99_ms')} | "
                f"{s.get('p999_ms')} | {s.get('errors')} |"
            )
    if results.get("rollouts"):
        lines += _p99_table(results["rollouts"], "rollouts")
    tp = results.get("throughput")
    if tp:
        c = tp["_config"]
        lines += [
            "",
            f"Throughput ({c['clients']} clients in {c['processes']} processes, "
            f"{c['rounds']} x {c['window_s']}s interleaved rounds, medians):",
            "",
            "| target | req/s | per round | server CPU µs/req | server CPU util | p50 ms | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, rec in tp.items():
            if name.startswith("_"):
                continue
            lines.append(
                f"| {name} | {rec['rps']:.0f} | {', '.join(str(round(r['rps'])) for r in rec['rounds'])} | "
                f"{rec['server_cpu_us_per_req']} | {rec['server_cpu_util']} | {rec['latency_p50_ms']} | "
                f"{rec['errors']} |"
            )
    if results.get("grpc_rollouts"):
        lines += rollouts_grpc.markdown(results)
        lines += _p99_table(results["grpc_rollouts"]["p99"], "gRPC Generate rollouts")
    lines += gateway.markdown(results)
    lines += fpm.markdown(results)
    lines += fpm_publish.markdown(results)
    lines += weights.markdown(results)
    lines += fleet.markdown(results)
    lines += tensor_parallel.markdown(results)
    lines += load_check.markdown(results)
    if results.get("notes"):
        lines += [""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"
