"""Node B for tests (bench/lib/two_node.py is the harness: what is set apart, the host
interface settings, the clean-up): `two_nodes()` skips a test where the host can not make node
B, and `shared_root` is a folder both nodes see in pytest's cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lib.two_node import NODE_HOSTNAME, NodeSetupError, TwoNodes, shared_model

__all__ = ["NODE_HOSTNAME", "NodeSetupError", "TwoNodes", "shared_model", "shared_root", "two_nodes"]


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


def shared_root(config: pytest.Config) -> Path:
    """A folder both nodes read and write at the same path (outside /tmp and /dev/shm):
    `two-node` in pytest's cache folder (.pytest_cache/d/two-node), kept across sessions."""
    if config.cache is None:
        pytest.skip("node B reads its model from pytest's cache folder, and the cache plugin is off")
    return Path(config.cache.mkdir("two-node"))
