"""The server <-> engine contract (see contract/engine.py and docs/architecture.md)."""
