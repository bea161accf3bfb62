"""The server's layers contract (pyproject.toml, `[tool.importlinter]`) names every module.

import-linter checks only the modules a layers contract names: a module left out may import
anything, which is how the transfer engine's room once sat outside the order. This test reads
the contract and fails for any module of server/ that no layer names, itself or through a
package above it (docs/architecture.md, "Modules").
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _layered() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c["containers"] == ["enginectl.server"]
    )
    return {name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer)}


def _modules() -> list[str]:
    server = ROOT / "server"
    names = []
    for path in sorted(server.rglob("*.py")):
        parts = path.relative_to(server).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.append(".".join(parts))
    return names


def test_every_server_module_is_in_a_layer() -> None:
    layered = _layered()
    missing = [
        module
        for module in _modules()
        if not any(module == name or module.startswith(name + ".") for name in layered)
        and module not in {"weights", "fpm"}  # the rooms' packages themselves: no code
    ]
    assert missing == [], f"server modules no layer names: {missing}"
