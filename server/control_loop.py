"""ControlLoop: the control plane's own event loop, on its own thread.

Runs in the `enginectl serve` process. vLLM's HTTP server and AsyncLLM share the main
event loop, which spends tens of milliseconds at a time processing generation output while
rollouts stream. Control calls must not queue behind that, so the gRPC server, the ledger
and every servicer live on this loop instead; the only things that cross back to the main
loop are calls into the engine (see EngineAdapter), through `run_on`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` on `loop` from any loop; cancelling the caller cancels it there too."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class ControlLoop:
    """An asyncio event loop (uvloop when available) running on a daemon thread."""

    def __init__(self, name: str = "enginectl-control") -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop ships with vLLM
            self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()
        # Cancel what is left (e.g. streams cut by a hard stop), then close the loop.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def start(self) -> ControlLoop:
        self._thread.start()
        self._started.wait()
        return self

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the control loop and await its result from the calling loop."""
        return await run_on(self.loop, coro)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread (call from another thread)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
