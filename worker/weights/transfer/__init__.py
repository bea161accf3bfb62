"""vLLM's weight-transfer API inside a vLLM worker: enginectl's `gloo` engine in vLLM's factory
(engine.py), the TRANSFER worker RPC that runs vLLM's four steps for enginectl's round
(steps.py), and the target a staged round writes to (staging_target.py).

Runs inside every vLLM worker process; every step runs on the worker's RPC thread, between
forward passes, the only thread that touches the weights (worker/weights/fingerprints.py, "who
may touch the weights"). Importing this package changes nothing in vLLM: `engine.register`
puts the engine in vLLM's factory, called where the worker extension is built and by vLLM's
plugin loader (pyproject.toml, `vllm.general_plugins`).
"""
