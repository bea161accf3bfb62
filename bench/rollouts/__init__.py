"""Rollouts over gRPC Generate vs vLLM's HTTP API (bench/README.md, figure 7)."""
