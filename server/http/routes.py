"""The HTTP RL routes on vLLM's app: every vocabulary's routes attached, in place of vLLM's own
at the same paths, and vLLM's dev routes that would go around the ledger refused.

Runs in the `enginectl serve` process: `mount` runs once on the main thread, before vLLM's
HTTP server serves (server/serve.py); the routes run on the engine's loop. The vocabularies,
each a module with its list of routes (docs/http_routes.md, "Route names"):
- vLLM's RL router: server/http/vllm_routes.py;
- SGLang's (also what SMG's `smg.rl` sends): server/http/sglang_routes.py;
- Dynamo's, under /engine/: server/http/dynamo_routes.py;
- vLLM's weight-transfer routes: server/http/transfer_routes.py.

vLLM's own dev-mode routes that pause, resume or change weights are replaced by these, or
refused with ROUTE_REFUSED (below): none goes around the ledger.
"""

from __future__ import annotations

from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response

from enginectl.common.vocabulary import Reason
from enginectl.server.http import dynamo_routes, sglang_routes, transfer_routes, vllm_routes
from enginectl.server.http.route_calls import Handler, RouteCalls
from enginectl.server.http.route_error import RouteError
from enginectl.server.http.router import Router

# vLLM's dev routes (VLLM_SERVER_DEV_MODE=1) that would pause, resume or change weights
# behind the ledger, and what to call instead. Answered PERMISSION_DENIED ROUTE_REFUSED.
REFUSED = {
    "/collective_rpc": "calls worker methods (reload_weights, ...) behind enginectl's ledger",
    "/sleep": "offloads or discards the weights behind enginectl's ledger",
    "/wake_up": "reloads weights behind enginectl's ledger",
    "/release_kv_cache_memory": "puts the engine to sleep behind enginectl's pause state",
    "/weight_checker": "resets weights behind enginectl's ledger; VerifyWeights checks them",
    "/start_draft_weight_update": "a draft model's round is not run through enginectl's ledger yet",
}


def _refusing(path: str) -> Handler:
    why = REFUSED[path]

    async def refuse(request: Request, calls: RouteCalls) -> Response:
        raise RouteError(
            grpc.StatusCode.PERMISSION_DENIED,
            Reason.ROUTE_REFUSED,
            f"{path} is refused under enginectl: it {why} (docs/http_routes.md)",
            metadata={"route": path},
        )

    return refuse


refused = Router()
for _path in REFUSED:
    refused.post(_path)(_refusing(_path))

ROUTERS = (vllm_routes.router, sglang_routes.router, dynamo_routes.router, transfer_routes.router, refused)


def mount(app: Any, calls: RouteCalls, *, keep_vllm_dev_routes: bool = False) -> tuple[list[str], list[str]]:
    """Put every route, over `calls`, on vLLM's FastAPI `app`, in place of any route of vLLM's
    at the same path (its dev-mode /pause, /resume, /collective_rpc, ...). Returns the paths
    of vLLM's routes replaced, and those kept: with `keep_vllm_dev_routes`
    (--allow-vllm-dev-routes) vLLM's routes of the REFUSED paths stay vLLM's where vLLM has
    them; the RL names are enginectl's all the same."""
    kept: list[str] = []
    if keep_vllm_dev_routes:
        present = {getattr(r, "path", None) for r in app.router.routes}
        kept = sorted(path for path in REFUSED if path in present)
    replaced = [path for router in ROUTERS for path in router.attach(app, calls, skip=frozenset(kept))]
    app.openapi_schema = None
    return sorted(replaced), kept
