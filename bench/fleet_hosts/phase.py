"""Phase `fleet_hosts`: a fleet of two single-node servers on two other hosts beside the same
fleet on this host, in one run (bench/README.md; docs/multinode.md, "A fleet across hosts").

Runs in the `python -m bench` process, which only orchestrates: it makes node-a and node-b
(bench/lib/two_node.py: each its own network, mount and UTS namespaces, both on one bridge with
this host, whose address there the trainer's broadcast group listens on; the phase is skipped,
saying why, where the host can not) and starts, at once, on the embedded tiny model, four
`enginectl serve` processes, every one with the same bearer token:

- `one_host`: two servers on this host, gRPC on 127.0.0.1;
- `two_hosts`: one server on node-a and one on node-b, gRPC on their own addresses.

Then `python -m bench.fleet_hosts.clients run` is the trainer of both fleets (its docstring
says what it times). Figures (reported; no target: the bridge crosses no wire, so these are
the costs of reaching servers through their hosts' addresses, not of a network): the two-host
fleet's broadcast update, tensor-stream update and status read over the one-host fleet's.
"""

from __future__ import annotations

import secrets
from typing import Any

from bench.lib.harness import ServeProcess, base_env, serve_command
from bench.lib.progress import log
from bench.lib.stats import reported_figure

FLEETS = ("one_host", "two_hosts")


class _NodeServe(ServeProcess):
    """`enginectl serve` on a node, gRPC on the node's address (tests/support/two_node.py's
    NodeServe without pytest)."""

    def __init__(self, node: Any, env: dict[str, str]) -> None:
        self.address = node.node_address
        args = ["--grpc-host", self.address]
        super().__init__(node.wrap(serve_command(args)), env, name=f"enginectl-{node.hostname}")

    @property
    def grpc_target(self) -> str:
        return f"{self.address}:{self.serving['grpc_port']}"


def phase(quick: bool) -> dict[str, Any]:
    from bench.lib.procs import Worker
    from bench.lib.two_node import Bridge, NodeSetupError, TwoNodes
    from enginectl.server.default_model import ensure_default_model

    model = ensure_default_model()  # under HOME, which the nodes share (their /tmp they do not)
    token = secrets.token_hex(16)
    bridge = Bridge()
    nodes = [TwoNodes(bridge=bridge, hostname=name) for name in ("node-a", "node-b")]
    try:
        bridge.start()
        for node in nodes:
            node.start()
    except NodeSetupError as exc:
        for node in nodes:
            node.close()
        bridge.close()
        log(f"fleet_hosts: skipped, no nodes on this host: {exc}")
        return {"skipped": str(exc)}
    servers: list[ServeProcess] = []
    try:
        env = {**base_env(), "ENGINECTL_TOKEN": token}
        local = [ServeProcess(serve_command(), env, name=f"enginectl-local-{i}") for i in range(2)]
        remote = [_NodeServe(node, node.node_env(ENGINECTL_TOKEN=token)) for node in nodes]
        servers = [*local, *remote]
        for server in servers:
            server.start()
        for node, server in zip(nodes, remote, strict=True):
            assert server.proc is not None
            node.track(server.proc)
        for server in servers:
            server.wait_ready()
        reps = 3 if quick else 10
        log(f"fleet_hosts: four servers ready; {reps} interleaved reps of each fleet")
        fleets = {
            "one_host": (",".join(s.grpc_target for s in local), "127.0.0.1"),
            "two_hosts": (",".join(s.grpc_target for s in remote), bridge.address),
        }
        specs = [x for n, (t, m) in fleets.items() for x in ("--fleet", f"{n}={t}@{m}")]
        worker = Worker(
            ["run", *specs, "--model", str(model), "--token", token, "--reps", str(reps)],
            module="bench.fleet_hosts.clients",
        )
        try:
            result = worker.expect("result", 1800)
        finally:
            worker.finish()
    finally:
        stops = {server.name: server.stop() for server in servers}
        for node in nodes:
            node.close()
        bridge.close()
    result.pop("event", None)
    return {**result, "server_stops": stops}


def figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    res = results.get("fleet_hosts")
    if not res or "skipped" in res:
        return []
    base = "the same fleet (two single-node servers) on this host, same run, reps interleaved"
    return [
        reported_figure(
            f"{what}, servers on node-a and node-b (bridge)",
            base,
            res[key]["one_host"]["median_ms"],
            res[key]["two_hosts"]["median_ms"],
        )
        for key, what in (
            ("broadcast", f"Fleet stage_broadcast + strict commit, tiny model ({res['num_tensors']} tensors), median"),
            ("tensors", "Fleet stage_from_tensors + strict commit, tiny model, median"),
            ("status", "Fleet.status(), median"),
        )
    ]
