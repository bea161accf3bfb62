"""PromptCalls: how many prompt control calls are in flight on the control loop.

Runs in the `enginectl serve` process, on the control loop (one thread: nothing is locked).
The RPC interceptor (server/interceptors.py) counts each call it deems prompt; work that
shares the loop and can wait, the FPM relay's intake (server/fpm/relay_zmq.py), asks `any()`
and takes smaller bites meanwhile. Both are handed the same instance when they are built
(server/wiring.py), so neither knows of the other.
"""

from __future__ import annotations

import asyncio
from typing import Any

# How long a call counts as prompt at most: a call that long (a pause waiting for requests, a
# group waiting for its trainer) is not one a few milliseconds matter to.
PROMPT_WINDOW_S = 0.1


class PromptCalls:
    """A count of calls in flight, each counted until it ends or `window_s` (PROMPT_WINDOW_S)
    passed; a call started after `window_s` changed counts for the new one."""

    def __init__(self, window_s: float = PROMPT_WINDOW_S) -> None:
        self.window_s = window_s
        self.in_flight = 0

    def any(self) -> bool:
        """Whether a prompt call is in flight now."""
        return self.in_flight > 0

    def track(self, call: asyncio.Task[Any]) -> None:
        """Count `call` (the task gRPC made for it, which ends once its status is sent) until
        it ends or `window_s` passed, whichever comes first."""
        counted = True

        def end(*_: object) -> None:
            nonlocal counted
            if counted:
                counted = False
                self.in_flight -= 1

        self.in_flight += 1
        call.add_done_callback(end)
        asyncio.get_running_loop().call_later(self.window_s, end)
