"""What a route's JSON says: its arguments read, typed and checked, before any RPC is made.

Runs in the `enginectl serve` process, on the engine's loop (vLLM's HTTP server). No state:
a bad argument raises RouteError INVALID_ARGUMENT with the field it names (docs/http_routes.md,
"Errors"); the routes of each vocabulary turn the arguments into RPC requests.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from starlette.requests import Request

from enginectl.common.vocabulary import Reason
from enginectl.server import limits
from enginectl.server.http.route_error import RouteError
from enginectl.weights.v1 import weight_update_service_pb2 as upd

# Pause modes by name: enginectl's and vLLM's (abort, wait, keep), SGLang's (in_place freezes
# requests where they are; retract frees their KV cache and runs them again later: either
# way they survive the pause, which is KEEP).
PAUSE_MODES = {
    "abort": upd.PAUSE_MODE_ABORT,
    "wait": upd.PAUSE_MODE_WAIT,
    "keep": upd.PAUSE_MODE_KEEP,
    "in_place": upd.PAUSE_MODE_KEEP,
    "retract": upd.PAUSE_MODE_KEEP,
}
GROUP_BACKENDS = {"gloo": upd.GROUP_BACKEND_GLOO, "nccl": upd.GROUP_BACKEND_NCCL}
# SGLang's load_format values enginectl reads (it loads safetensors only, never pickle).
LOAD_FORMATS = (None, "auto", "safetensors")


def bad(field: str, description: str, reason: str = Reason.MALFORMED_REQUEST) -> RouteError:
    return RouteError(
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
        f"{field}: {description}",
        violations=[{"field": field, "description": description}],
    )


class Body:
    """A route's arguments: the JSON object of the body, over the query string's values
    (vLLM's routes take query parameters, SGLang's a body; both are read)."""

    def __init__(self, values: dict[str, Any], query: dict[str, str]) -> None:
        self._values = values
        self._query = query

    @classmethod
    async def read(cls, request: Request) -> Body:
        raw = await request.body()
        values: Any = {}
        if raw.strip():
            try:
                values = json.loads(raw)
            except ValueError as err:
                raise RouteError(
                    grpc.StatusCode.INVALID_ARGUMENT, Reason.MALFORMED_REQUEST, f"the body is not JSON: {err}"
                ) from None
        if not isinstance(values, dict):
            raise RouteError(
                grpc.StatusCode.INVALID_ARGUMENT, Reason.MALFORMED_REQUEST, "the body must be a JSON object"
            )
        return cls(values, dict(request.query_params))

    def _get(self, key: str) -> Any:
        if key in self._values and self._values[key] is not None:
            return self._values[key]
        return self._query.get(key)

    def has(self, key: str) -> bool:
        return self._get(key) is not None

    def value(self, key: str) -> Any:
        """The value as it came (None when absent), for the caller to check."""
        return self._get(key)

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self._get(key)
        if value is None:
            if required:
                raise bad(key, "required")
            return default
        if not isinstance(value, str):
            raise bad(key, "must be a string")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
            return value.lower() in ("true", "1")
        raise bad(key, "must be a boolean")

    def number(self, key: str) -> float | None:
        value = self._get(key)
        if value is None:
            return None
        if isinstance(value, bool):
            raise bad(key, "must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad(key, "must be a number") from None

    def integer(self, key: str, *, required: bool = False) -> int | None:
        value = self.number(key)
        if value is None:
            if required:
                raise bad(key, "required")
            return None
        if value != int(value) or value < 0:
            raise bad(key, "must be a non-negative integer")
        return int(value)

    def strings(self, key: str) -> list[str]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "must be a list of strings")
        return value


def pause_mode(body: Body, default: str) -> upd.PauseMode.ValueType:
    name = body.string("mode", default)
    assert name is not None
    mode = PAUSE_MODES.get(name.lower())
    if mode is None:
        raise bad("mode", f"one of {', '.join(PAUSE_MODES)}", Reason.PAUSE_MODE_INVALID)
    return mode


def set_timeout(body: Body, key: str, message: Any) -> float:
    """Sets `message.<key>` from the body's `timeout` (seconds); returns the update's bound."""
    seconds = body.number("timeout")
    if seconds is None:
        return limits.DEFAULT_TIMEOUT_S
    if seconds <= 0 or seconds > limits.MAX_TIMEOUT_S:
        raise bad("timeout", f"must be in (0, {limits.MAX_TIMEOUT_S:g}] seconds", Reason.TIMEOUT_INVALID)
    getattr(message, key).FromMilliseconds(int(seconds * 1000))
    return seconds


def update_options(body: Body, message: Any) -> None:
    """The options every update takes: version, pause mode, prefix cache reset. SGLang's
    `abort_all_requests: true` is PAUSE_MODE_ABORT; its `flush_cache` is reset_prefix_cache."""
    version = body.string("weight_version")
    if version is not None:
        message.weight_version = version
    if body.has("mode"):
        message.pause_mode = pause_mode(body, "keep")
    elif body.flag("abort_all_requests"):
        message.pause_mode = upd.PAUSE_MODE_ABORT
    for key in ("reset_prefix_cache", "flush_cache"):
        if body.has(key):
            message.reset_prefix_cache = body.flag(key)
