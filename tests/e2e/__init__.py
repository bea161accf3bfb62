"""Tests that start real processes: `enginectl serve` with a vLLM engine on the embedded tiny
model, the `enginectl` CLI, trainers and other clients as child processes. Slow; `make test`
runs them after the unit tests."""
