"""In-process tests: pure code, in-memory doubles (tests/support/engine_double.py) and real
gRPC servers on loopback in this process; no `enginectl serve`, no vLLM engine, no child
process. `make unit` runs them alone, in seconds."""
