"""What an `enginectl serve` tells the SMG gateway about itself, and a small client of SMG's
worker API (`/workers`).

Stdlib only: imported by the `enginectl serve` process (server/gateway.py, on the control
loop, through `asyncio.to_thread`) and by the `enginectl` command (cli/gateway.py), so both
build one registration. Every SmgWorkers method blocks on its HTTP calls, each within the timeout.

SMG's side, as measured against smg 1.13.0 (docs/rollouts.md, "Behind the SMG gateway"): POST /workers
queues a registration (202, `worker_id`; 409 WORKER_ALREADY_EXISTS for a URL it holds);
PATCH /workers/{id} merges labels; DELETE /workers/{id} removes; GET /workers lists the
workers it holds, with their labels. A label value is a string; SMG reads a worker's
`weight_version` label as the version it stamps on completions, `default` meaning unversioned,
and versions are printable ASCII without spaces, at most 128 bytes. An enginectl version
outside that syntax is unrepresentable: the label is cleared ("") and
`enginectl.weight_version_unrepresentable` says so, never another version.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Label keys (the ones enginectl owns on its SMG row).
CONTROL_URL_LABEL = "rl.control_url"  # where SMG's RL plane proxies the HTTP RL routes
VERSION_LABEL = "weight_version"  # what SMG stamps on completions
ENGINECTL_LABEL = "enginectl"  # the server's enginectl version: "this worker is enginectl"
INCARNATION_LABEL = "enginectl.incarnation"  # the server start (WeightVersion.incarnation)
RL_ROUTES_LABEL = "enginectl.rl_routes"  # the RL route families served on rl.control_url
UNREPRESENTABLE_LABEL = "enginectl.weight_version_unrepresentable"  # "true": the declared version is not SMG syntax
OWN_LABELS = (
    CONTROL_URL_LABEL,
    VERSION_LABEL,
    ENGINECTL_LABEL,
    INCARNATION_LABEL,
    RL_ROUTES_LABEL,
    UNREPRESENTABLE_LABEL,
)

RL_ROUTES = "vllm,sglang,dynamo"  # docs/http_routes.md, "Route names"
SMG_MAX_VERSION_BYTES = 128
SMG_UNVERSIONED = "default"  # what SMG stamps for a worker with no version: never sent as one
CLEARED = ""  # the label value of "no version": SMG stamps `system_fingerprint: ""`
DEFAULT_TIMEOUT_S = 5.0


def representable(version: str) -> bool:
    """Whether SMG can carry `version` as a worker's `weight_version`: 1..128 bytes of
    printable ASCII without spaces, and not "default" (SMG's word for unversioned)."""
    return (
        0 < len(version) <= SMG_MAX_VERSION_BYTES
        and all("!" <= ch <= "~" for ch in version)
        and version != SMG_UNVERSIONED
    )


@dataclass(frozen=True)
class VersionLabels:
    """The version labels for one ledger state: the version SMG may stamp ("" when none) and
    whether a declared version could not be carried."""

    version: str
    unrepresentable: bool

    def labels(self) -> dict[str, str]:
        """The labels sent: both keys always, so a PATCH also undoes an earlier state."""
        return {VERSION_LABEL: self.version, UNREPRESENTABLE_LABEL: "true" if self.unrepresentable else "false"}


def version_labels(declared: bool, version: str | None) -> VersionLabels:
    """What SMG should hold for a ledger state: the declared version when representable,
    else cleared; undeclared (never declared, or after a partial update) is cleared too."""
    if not declared or not version:
        return VersionLabels(CLEARED, False)
    if not representable(version):
        return VersionLabels(CLEARED, True)
    return VersionLabels(version, False)


def url_host(host: str) -> str:
    """`host` as it goes into a URL: IPv6 addresses in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def advertise_host(bind_host: str) -> str:
    """The host other machines reach a server on that binds `bind_host`: that host, unless it
    is a wildcard (0.0.0.0, ::, ""), then this machine's host name's address (or the name)."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


@dataclass(frozen=True)
class Registration:
    """One worker as SMG's POST /workers takes it."""

    url: str  # grpc://HOST:GRPC_PORT: SMG routes vLLM's VllmEngine service there
    api_key: str | None  # the server's token: SMG sends it upstream as `Authorization: Bearer`
    labels: Mapping[str, str] = field(default_factory=dict)
    unrepresentable_version: str | None = None  # the declared version SMG could not carry

    def body(self) -> dict[str, Any]:
        """The JSON body of POST /workers (no `api_key` when the server has no token)."""
        body: dict[str, Any] = {"url": self.url, "labels": dict(self.labels)}
        if self.api_key:
            body["api_key"] = self.api_key
        return body

    def redacted(self) -> dict[str, Any]:
        """`body()` with the api key masked, for printing and logs."""
        body = self.body()
        if "api_key" in body:
            body["api_key"] = "<redacted>"
        return body


def registration(
    *,
    host: str,
    grpc_port: int,
    http_port: int,
    token: str | None,
    declared: bool,
    version: str | None,
    enginectl_version: str,
    incarnation: str,
) -> Registration:
    """The registration of the server reachable on `host` (its gRPC port serves vLLM's
    VllmEngine, its HTTP port the RL routes), with the version labels of its ledger state."""
    h = url_host(host)
    versions = version_labels(declared, version)
    labels = {
        CONTROL_URL_LABEL: f"http://{h}:{http_port}",
        ENGINECTL_LABEL: enginectl_version,
        INCARNATION_LABEL: incarnation,
        RL_ROUTES_LABEL: RL_ROUTES,
        **versions.labels(),
    }
    return Registration(
        url=f"grpc://{h}:{grpc_port}",
        api_key=token,
        labels=labels,
        unrepresentable_version=version if versions.unrepresentable else None,
    )


class GatewayError(Exception):
    """A call to SMG failed: `status` is the HTTP status (None when SMG could not be reached
    or answered something that is not HTTP), `code` SMG's error code (e.g.
    WORKER_NOT_FOUND, "" when it gave none), `body` what it answered."""

    def __init__(self, method: str, url: str, status: int | None, body: str, code: str = "") -> None:
        what = f"HTTP {status}" if status is not None else "unreachable"
        super().__init__(f"{method} {url}: {what}: {body[:300]}")
        self.method, self.url, self.status, self.body, self.code = method, url, status, body, code

    @property
    def unreachable(self) -> bool:
        """No HTTP answer: connection refused, reset, timed out, ..."""
        return self.status is None

    @property
    def not_found(self) -> bool:
        return self.status == 404


class SmgWorkers:
    """SMG's worker API at `base_url` (e.g. http://127.0.0.1:30000); `token`, when given, is
    sent as `Authorization: Bearer` (SMG's --control-plane-api-keys / --api-key)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None, timeout: float | None = None) -> Any:
        url = self.base_url + path
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout if timeout is None else timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            raise GatewayError(method, url, err.code, text, _error_code(text)) from None
        except (OSError, ValueError) as err:  # URLError, refused, reset, timeout; a bad URL
            raise GatewayError(method, url, None, str(getattr(err, "reason", err))) from None
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            raise GatewayError(method, url, None, f"not JSON: {raw[:200]!r}") from None

    def register(self, reg: Registration) -> str:
        """Register `reg` and return its worker id. A URL SMG already holds is updated in place
        (its labels PATCHed), never registered twice. SMG adds the worker in the background."""
        existing = self.find_by_url(reg.url)
        if existing is not None:
            self.patch_labels(existing["id"], reg.labels)
            return str(existing["id"])
        try:
            answer = self._call("POST", "/workers", reg.body())
        except GatewayError as err:
            if err.status != 409:
                raise
            existing = self.find_by_url(reg.url)  # registered meanwhile
            if existing is None:  # still being added (WORKER_CREATE_IN_PROGRESS): try again later
                raise
            self.patch_labels(existing["id"], reg.labels)
            return str(existing["id"])
        return str(answer["worker_id"])

    def workers(self) -> list[dict[str, Any]]:
        """Every worker SMG holds (GET /workers), as it describes them."""
        return list(self._call("GET", "/workers").get("workers", []))

    def find_by_url(self, url: str) -> dict[str, Any] | None:
        """The worker SMG holds at `url`, or None."""
        return next((w for w in self.workers() if w.get("url") == url), None)

    def get(self, worker_id: str) -> dict[str, Any]:
        """One worker (GET /workers/{id}); GatewayError 404 when SMG does not hold it."""
        return dict(self._call("GET", f"/workers/{_quote(worker_id)}"))

    def patch_labels(self, worker_id: str, labels: Mapping[str, str]) -> None:
        """Merge `labels` into the worker's (PATCH /workers/{id}); SMG applies it in the
        background. GatewayError 404 when SMG does not hold the worker."""
        self._call("PATCH", f"/workers/{_quote(worker_id)}", {"labels": dict(labels)})

    def deregister(self, worker_id: str, timeout: float | None = None) -> None:
        """Remove the worker (DELETE /workers/{id}); SMG removes it in the background.
        `timeout` bounds this call (default: the client's)."""
        self._call("DELETE", f"/workers/{_quote(worker_id)}", timeout=timeout)


def _quote(worker_id: str) -> str:
    return urllib.parse.quote(worker_id, safe="")


def _error_code(text: str) -> str:
    """SMG's error code from its JSON error body (`{"error": ..., "code": ...}`), if any."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return ""
    return str(body.get("code", "")) if isinstance(body, dict) else ""
