"""Shared by the bench's families: servers and load generators as subprocesses, the JSON-lines
protocol, statistics, the synthetic checkpoints and the bench's worker extension."""
