"""One EngineCore utility call on every DP rank at once (server/engine.py EngineAdapter's
`_call_each`): vLLM's `call_utility_async` answers for the first engine only, so the calls go
to each engine by its identity, and each rank's outcome is its answer, a timeout, an error or
the engine's death (worker_calls.py `RankOutcome`).

Runs in the `enginectl serve` process, on the engine's loop (the one AsyncLLM runs on).
"""

from __future__ import annotations

import asyncio
from typing import Any

from enginectl.contract.engine import RankFailure
from enginectl.server.worker_calls import RankOutcome


async def call_each_core(core: Any, method: str, args: tuple[Any, ...], timeout: float) -> list[RankOutcome[Any]]:
    """Runs on the engine's loop: one utility call per EngineCore of `core` (AsyncLLM's core
    client), all started at once, each bounded by `timeout`: every rank's answer or why not."""
    from vllm.v1.engine.exceptions import EngineDeadError

    ranks = [int.from_bytes(engine, "little") for engine in core.core_engines]
    calls = [
        asyncio.ensure_future(core._call_utility_async(method, *args, engine=engine)) for engine in core.core_engines
    ]
    await asyncio.wait(calls, timeout=max(timeout, 0.0))
    outcomes: list[RankOutcome[Any]] = []
    for rank, call in zip(ranks, calls, strict=True):
        if not call.done():
            call.cancel()
            outcomes.append(
                RankOutcome(rank, failure=RankFailure.RANK_TIMEOUT, message=f"no answer within {timeout:.3f}s")
            )
        elif isinstance(call.exception(), EngineDeadError):
            outcomes.append(RankOutcome(rank, failure=RankFailure.ENGINE_DEAD, message=str(call.exception())))
        elif call.exception() is not None:
            outcomes.append(RankOutcome(rank, failure=RankFailure.RANK_ERROR, message=str(call.exception())))
        else:
            outcomes.append(RankOutcome(rank, result=call.result()))
    return outcomes
