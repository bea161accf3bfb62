"""The HTTP RL routes on vLLM's HTTP port: vLLM's, SGLang's and Dynamo's names for the control
plane's RPCs (docs/http_routes.md)."""
