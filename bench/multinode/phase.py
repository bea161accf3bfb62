"""Phase `multinode`: one engine whose rank 1 runs on node B beside the same engine on one host,
in one run (bench/README.md; docs/multinode.md).

Runs in the `python -m bench` process, which only orchestrates: it makes node B
(bench/lib/two_node.py: its own network namespace over a veth pair, its own /tmp, /dev/shm and
host name; the phase is skipped, saying why, where the host can not) and starts, at once, on the
embedded tiny model:

- `one_host`: `enginectl serve --data-parallel-size 2`, both ranks on this host;
- `two_node`: the head `enginectl serve --data-parallel-size 2 --data-parallel-size-local 1
  --data-parallel-address HEAD ...` (rank 0) and, on node B, `enginectl serve --headless ...
  --data-parallel-start-rank 1` (rank 1), every update channel and FPM sample of rank 1 over
  TCP on the veth pair, keyed.

Then `python -m bench.multinode.clients run` measures both (its docstring says how). Figures
(reported; no target: the veth pair crosses no wire, so these are the costs of the transports
enginectl chooses, TCP and keys instead of ipc://, not of a network): the two-node engine's
GetWeightVersion p50, pause+resume and tensor-stream update over the one-host engine's; and,
on the two-node engine, the FPM latency of rank 1's samples over rank 0's, with each rank's
delivery.
"""

from __future__ import annotations

from typing import Any

from bench.lib.harness import BIN, ServeProcess, base_env, serve_command
from bench.lib.progress import log
from bench.lib.stats import reported_figure

SERVERS = ("one_host", "two_node")


def phase(quick: bool) -> dict[str, Any]:
    from bench.lib.procs import Worker, free_port
    from bench.lib.two_node import NodeSetupError, TwoNodes
    from enginectl.server.default_model import ensure_default_model

    model = ensure_default_model()  # under HOME, which node B shares (its /tmp it does not)
    nodes = TwoNodes()
    try:
        nodes.start()
    except NodeSetupError as exc:
        log(f"multinode: skipped, no node B on this host: {exc}")
        return {"skipped": str(exc)}
    servers: dict[str, ServeProcess] = {}
    try:
        common = ["--data-parallel-size", "2", "--enable-scale-out"]
        servers["one_host"] = ServeProcess(serve_command(common), base_env(), name="enginectl-one-host")
        dp = [*common, "--data-parallel-size-local", "1", "--data-parallel-address", nodes.head_address]
        dp += ["--data-parallel-rpc-port", str(free_port())]
        servers["two_node"] = ServeProcess(serve_command(dp), nodes.head_env(base_env()), name="enginectl-head")
        node_b = ServeProcess(
            nodes.wrap([str(BIN / "enginectl"), "serve", "--headless", *dp, "--data-parallel-start-rank", "1"]),
            nodes.node_env(),
            name="enginectl-node-b",
        )
        for server in servers.values():
            server.start()
        node_b.start()
        assert node_b.proc is not None
        nodes.track(node_b.proc)
        for server in servers.values():
            server.wait_ready()
        reps, window = (3, 4.0) if quick else (10, 15.0)
        log(f"multinode: both engines ready; {reps} interleaved reps, then a {window:.0f}s FPM window on each")
        targets = [x for n, s in servers.items() for x in ("--target", f"{n}={s.grpc_target},{s.http_url}")]
        worker = Worker(
            ["run", *targets, "--model", str(model), "--reps", str(reps), "--window", str(window)],
            module="bench.multinode.clients",
        )
        try:
            result = worker.expect("result", 1800)
        finally:
            worker.finish()
    finally:
        stops = {name: server.stop() for name, server in servers.items()}
        nodes.close()
    result.pop("event", None)
    return {**result, "server_stops": stops}


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("multinode")
    if not res or "skipped" in res:
        return []
    base = "the same engine (DP=2) with both ranks on one host, same run, reps interleaved"
    out = []
    for key, what, stat in (
        ("read", "GetWeightVersion p50", "p50_ms"),
        ("pause_resume", "PauseGeneration + ResumeGeneration (every rank), median", "median_ms"),
        ("tensors", f"UpdateWeightsFromTensors, tiny model ({res['num_tensors']} tensors), median", "median_ms"),
    ):
        one, two = res[key]["one_host"][stat], res[key]["two_node"][stat]
        out.append(reported_figure(f"{what}, rank 1 on node B (veth pair)", base, one, two))
    fpm = res["fpm"]["two_node"]
    local, remote = fpm["0"], fpm["1"]
    for stat in ("p50_ms", "p99_ms"):
        out.append(
            reported_figure(
                f"FPM sample latency {stat[:-3]} (emit to subscriber), rank 1 on node B",
                "rank 0 of the same engine, on the head, same window",
                local["latency"].get(stat),
                remote["latency"].get(stat),
                floor=(
                    f"delivered rank 0 / rank 1: {local['delivered']} / {remote['delivered']} "
                    f"({local['samples']} / {remote['samples']} samples, {fpm['missed']} missed); one host: "
                    f"rank 1 p50 {res['fpm']['one_host']['1']['latency'].get('p50_ms')} ms"
                ),
            )
        )
    return out
