"""Calls to a server's HTTP RL routes (docs/http_routes.md): JSON in, (status, JSON) out."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(
    base_url: str,
    path: str,
    body: Any = None,
    *,
    method: str | None = None,
    token: str | None = None,
    raw: bytes | None = None,
    timeout: float = 120.0,
) -> tuple[int, dict[str, Any]]:
    """POST `body` (GET when there is none and no `raw`) to `base_url + path`."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    verb = method or ("POST" if data is not None else "GET")
    request = urllib.request.Request(f"{base_url}{path}", data=data, method=verb, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
