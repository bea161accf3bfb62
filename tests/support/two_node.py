"""Node B for tests (bench/lib/two_node.py is the harness: what is set apart, the host
interface settings, the clean-up): `two_nodes()` skips a test where the host can not make node
B, and `shared_root` is a folder both nodes see in pytest's cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import pytest

from bench.lib import harness
from bench.lib.harness import BIN
from bench.lib.two_node import NODE_HOSTNAME, Bridge, NodeSetupError, TwoNodes, shared_model

__all__ = [
    "NODE_HOSTNAME",
    "Bridge",
    "NodeServe",
    "NodeSetupError",
    "TwoNodes",
    "bridged_nodes",
    "shared_model",
    "shared_root",
    "two_nodes",
]


@contextlib.contextmanager
def two_nodes() -> Iterator[TwoNodes]:
    """`TwoNodes` for a test, skipped (with the step that failed) where the host can not
    make node B."""
    nodes = TwoNodes()
    try:
        nodes.start()
    except NodeSetupError as exc:
        pytest.skip(f"no node B on this host: {exc}")
    try:
        yield nodes
    finally:
        nodes.close()


@contextlib.contextmanager
def bridged_nodes(*hostnames: str) -> Iterator[tuple[Bridge, list[TwoNodes]]]:
    """A node per host name, all on one bridge with this host (`Bridge.address`, where a
    trainer here listens): the nodes reach each other and this host, as hosts on one switch.
    Skipped where the host can not make them."""
    with contextlib.ExitStack() as stack:
        try:
            bridge = stack.enter_context(Bridge())
            nodes = [stack.enter_context(TwoNodes(bridge=bridge, hostname=name)) for name in hostnames]
        except NodeSetupError as exc:
            pytest.skip(f"no bridged nodes on this host: {exc}")
        yield bridge, nodes


class NodeServe(harness.ServeProcess):
    """`enginectl serve --log-json ARGS` as `node`, its gRPC and HTTP ports on the node's
    address (reachable from this host and the other nodes); `grpc_target` and `http_url` name
    that address. Without a token or TLS in ARGS or `env`, pass --insecure."""

    def __init__(self, node: TwoNodes, args: Sequence[str], env: dict[str, str], name: str = "") -> None:
        self.node = node
        address = node.node_address
        command = [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0", "--log-json"]
        command += ["--grpc-host", address, "--host", address, *args]
        super().__init__(node.wrap(command), env, name=name or node.hostname, keep_lines=True)

    def start(self) -> NodeServe:
        super().start()
        assert self.proc is not None
        self.node.track(self.proc)  # killed with the node at the latest
        return self

    @property
    def grpc_target(self) -> str:
        return f"{self.node.node_address}:{self.serving['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"http://{self.node.node_address}:{self.http_port}"

    def fail(self, message: str) -> NoReturn:
        pytest.fail(message)


def shared_root(config: pytest.Config) -> Path:
    """A folder both nodes read and write at the same path (outside /tmp and /dev/shm):
    `two-node` in pytest's cache folder (.pytest_cache/d/two-node), kept across sessions."""
    if config.cache is None:
        pytest.skip("node B reads its model from pytest's cache folder, and the cache plugin is off")
    return Path(config.cache.mkdir("two-node"))
