"""Router: one vocabulary's routes, a list the app is given once (as vLLM's
`vllm/entrypoints/serve/<concern>/api_router.py` and its `attach_router(app)`).

Runs in the `enginectl serve` process: each vocabulary declares its routes when its module is
imported; server/http/routes.py `mount` attaches them to vLLM's app on the main thread, before
it serves; they run on the engine's loop (vLLM's HTTP server). Unlike FastAPI's APIRouter, a
route reads its own arguments (server/http/body.py) and is handed the RouteCalls it calls
through; what it raises, a RouteError or a call the control plane refused, is answered as
JSON with the HTTP status of its gRPC code (server/http/answers.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from enginectl.server.errors import CallAborted
from enginectl.server.http.answers import error_response
from enginectl.server.http.route_calls import Handler, RouteCalls
from enginectl.server.http.route_error import RouteError, status_error


@dataclass(frozen=True)
class RlRoute:
    """One route: its path, its HTTP methods and what answers it."""

    path: str
    methods: tuple[str, ...]
    handler: Handler


class Router:
    """A vocabulary's routes, in the order declared."""

    def __init__(self) -> None:
        self.routes: list[RlRoute] = []

    def route(self, path: str, *methods: str) -> Callable[[Handler], Handler]:
        """Declares `path`, answered by the decorated handler for `methods`."""

        def add(handler: Handler) -> Handler:
            self.routes.append(RlRoute(path, methods, handler))
            return handler

        return add

    def post(self, path: str) -> Callable[[Handler], Handler]:
        return self.route(path, "POST")

    def get(self, path: str) -> Callable[[Handler], Handler]:
        return self.route(path, "GET")

    def include(self, prefix: str, *routers: Router) -> None:
        """Every route of `routers` again under `prefix`, but where this router answers the
        path itself."""
        own = {route.path for route in self.routes}
        for router in routers:
            self.routes += [
                RlRoute(prefix + route.path, route.methods, route.handler)
                for route in router.routes
                if prefix + route.path not in own
            ]

    def attach(self, app: Any, calls: RouteCalls, *, skip: frozenset[str] = frozenset()) -> list[str]:
        """Put these routes, over `calls`, on vLLM's FastAPI `app` in place of its routes at the
        same paths, but the paths of `skip`, left to vLLM. Returns the paths of vLLM's routes
        replaced."""
        from starlette.routing import Route

        ours = [route for route in self.routes if route.path not in skip]
        paths = {route.path for route in ours}
        replaced = sorted({r.path for r in app.router.routes if getattr(r, "path", None) in paths})
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in paths]
        for route in ours:
            endpoint = _answering(route.handler, calls)
            app.router.routes.append(Route(route.path, endpoint, methods=list(route.methods), include_in_schema=True))
        return replaced


def _answering(handler: Handler, calls: RouteCalls) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, calls)
        except RouteError as error:
            return error_response(error)
        except CallAborted as aborted:
            return error_response(status_error(aborted.status))

    endpoint.__doc__ = handler.__doc__
    return endpoint
