"""enginectl: a gRPC control plane inside a vLLM engine.

`enginectl.client` is the typed client (no torch, no vLLM); `enginectl.server` runs
`enginectl serve`; `enginectl.worker` runs inside vLLM's processes. Generated protobuf code
lives under `enginectl.weights.v1` and `enginectl.fpm.v1`.
"""

__version__ = "0.1.0"
