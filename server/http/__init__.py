"""The HTTP RL routes on vLLM's HTTP port: vLLM's, SGLang's and Dynamo's names for the control
plane's RPCs (docs/http_routes.md), one module of routes per vocabulary (vllm_routes,
sglang_routes, dynamo_routes, transfer_routes), attached by routes.py `mount`. They run in
the `enginectl serve` process, on the engine's loop, and call the servicers through
server/local_plane.py."""
