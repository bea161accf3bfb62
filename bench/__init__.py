"""enginectl benchmarks (bench/README.md): `python -m bench` from the repository root."""
