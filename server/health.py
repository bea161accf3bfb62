"""ServingHealth: whether this server is SERVING, and why not.

Runs in the `enginectl serve` process, on the control loop. One object holds the four things
that decide it (the server is up, an update left the weights mixed, the server is stopping,
the engine died) and says it two ways: gRPC health, for the whole server ("") and for every
service of the control plane, and `unhealthy()`, the reason vLLM's VllmEngine/HealthCheck
reports (server/rollouts.py), since gateways (SMG) ask only that. It is built before the
weight updates (server/wiring.py), which are handed `set_quarantined`.
"""

from __future__ import annotations

from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2

SERVICE_NAME = health.SERVICE_NAME


class ServingHealth:
    """gRPC health of "" and of `services`, from the state below (see the module docstring)."""

    def __init__(self, services: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._services = ("", *services)
        self._engine_dead = False
        self._serving = False  # set_serving(True) was called (the server is up)
        self._quarantined = False  # an update failed part-way: the weights may be mixed
        self._stopping = False  # stopping() began

    async def set_serving(self, serving: bool) -> None:
        """SERVING once the server is up, unless quarantined; once the engine died it stays
        NOT_SERVING."""
        self._serving = serving
        await self._apply()

    async def set_quarantined(self, quarantined: bool) -> None:
        """An update failed part-way (or the engine holds its mixed weights again): NOT_SERVING
        so routers, gateways and readiness probes take this server out, until an update
        succeeds. A forced resume lets generation run but keeps the quarantine
        (docs/operations.md, "Quarantine")."""
        self._quarantined = quarantined
        await self._apply()

    async def engine_died(self) -> None:
        """NOT_SERVING for good."""
        self._engine_dead = True
        await self._apply()

    async def stopping(self) -> None:
        """The server is shutting down: NOT_SERVING for every service, and watchers told so."""
        self._stopping = True
        await self.servicer.enter_graceful_shutdown()

    def unhealthy(self) -> str:
        """Why this server is NOT_SERVING ("" while SERVING)."""
        if self._engine_dead:
            return "the engine died"
        if self._stopping:
            return "the server is shutting down"
        if self._quarantined:
            return "quarantined: the last update failed part-way and the weights may be mixed"
        if not self._serving:
            return "not serving yet (starting, or awaiting its worker identity)"
        return ""

    async def _apply(self) -> None:
        serving = not self.unhealthy()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._services:
            await self.servicer.set(name, status)
