"""enginectl benchmarks (DESIGN §8): `python -m bench` from the repository root."""
