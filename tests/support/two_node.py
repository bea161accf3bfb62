"""Node B for tests (bench/lib/two_node.py is the harness: what is set apart, the host
interface settings, the clean-up): `two_nodes()` skips a test only where the host lacks what
node B needs (root, the tools: HostCannotMakeNodes) and fails it where making node B failed,
and `shared_root` is a folder both nodes see in pytest's cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import pytest

from bench.lib import harness
from bench.lib.harness import BIN
from bench.lib.two_node import NODE_HOSTNAME, Bridge, HostCannotMakeNodes, NodeSetupError, TwoNodes, shared_model

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


def _no_nodes(exc: NodeSetupError) -> NoReturn:
    """Skip where this host lacks what node B needs; fail where making it failed (a host that
    can make nodes must: a skip there would hide a broken harness)."""
    if isinstance(exc, HostCannotMakeNodes):
        pytest.skip(f"no node B on this host: {exc}")
    pytest.fail(f"node B could not be made: {exc}")


@contextlib.contextmanager
def two_nodes() -> Iterator[TwoNodes]:
    """`TwoNodes` for a test (see _no_nodes where it can not be made)."""
    nodes = TwoNodes()
    try:
        nodes.start()
    except NodeSetupError as exc:
        _no_nodes(exc)
    try:
        yield nodes
    finally:
        nodes.close()


@contextlib.contextmanager
def bridged_nodes(*hostnames: str) -> Iterator[tuple[Bridge, list[TwoNodes]]]:
    """A node per host name, all on one bridge with this host (`Bridge.address`, where a
    trainer here listens): the nodes reach each other and this host, as hosts on one switch.
    See _no_nodes where they can not be made."""
    with contextlib.ExitStack() as stack:
        try:
            bridge = stack.enter_context(Bridge())
            nodes = [stack.enter_context(TwoNodes(bridge=bridge, hostname=name)) for name in hostnames]
        except NodeSetupError as exc:
            _no_nodes(exc)
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
    `two-node` in pytest's cache folder (.pytest_cache/d/two-node), kept across sessions;
    build/two-node in the repository when the cache plugin is off (-p no:cacheprovider)."""
    cache = getattr(config, "cache", None)  # absent, not None, with the plugin off
    if cache is None:
        folder = config.rootpath / "build" / "two-node"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return Path(cache.mkdir("two-node"))
