"""WorkerCalls: how a worker RPC reaches every worker of every EngineCore, within its deadline.

Runs in the `enginectl serve` process. EngineAdapter (engine.py) owns one and hands it what it
needs of the engine: its per-rank utility calls (`CallAll`, `CallEach`) and its death report;
this module never touches AsyncLLM or the engine core client itself. Its methods are awaited
on the control loop (control_loop.py); the hooks that read the answers as they arrive run on
the engine's loop, inside EngineAdapter's calls.

docs/architecture.md, "Worker calls and their deadlines", says why every worker RPC goes
through the EngineCore utility Utility.WORKER_CALL, bounded by its timeout there, and what a
late answer means. EngineCores without enginectl's utilities get vLLM's own collective_rpc.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from enginectl.contract.engine import (
    QUICK_RPC_TIMEOUT_S,
    RankFailure,
    Utility,
    VllmUtility,
    WorkerCall,
    WorkerRpc,
    read,
)
from enginectl.server.errors import ControlPlaneError, Reason

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class RankOutcome(Generic[T]):
    """One rank's answer to a per-rank call: `result`, or a `failure` with a message."""

    dp_rank: int
    result: T | None = None
    failure: RankFailure | None = None
    message: str = ""

    def map(self, convert: Callable[[Any], U]) -> RankOutcome[U]:
        """The same outcome with `result` converted (a failure stays as it is). A result the
        contract can not read becomes a RANK_ERROR of that rank."""
        if self.failure is not None:
            return RankOutcome(self.dp_rank, None, self.failure, self.message)
        try:
            return RankOutcome(self.dp_rank, convert(self.result))
        except (ValueError, TypeError) as exc:  # msgspec.ValidationError is a ValueError
            return RankOutcome(self.dp_rank, None, RankFailure.RANK_ERROR, f"unreadable answer: {exc}")
        except ControlPlaneError as exc:  # the rank's late answer (`_answers`)
            failure = RankFailure.RANK_TIMEOUT if exc.reason == Reason.WORKER_TIMEOUT else RankFailure.ENGINE_DEAD
            return RankOutcome(self.dp_rank, None, failure, exc.message)


class CallAll(Protocol):
    """EngineAdapter's `_call_all`: an EngineCore utility on every DP rank, one answer per
    rank in rank order. `arrived` sees the answers on the engine's loop as soon as they are
    in; `what` names the call in the ENGINE_DEAD a failure there becomes (default `method`)."""

    def __call__(
        self, method: str, *args: Any, what: str | None = ..., arrived: Callable[[list[Any]], None] | None = ...
    ) -> Awaitable[list[Any]]: ...


class CallEach(Protocol):
    """EngineAdapter's `_call_each`: an EngineCore utility on every DP rank, each call on its
    own and bounded by `timeout`, one outcome per rank in rank order. `arrived` sees the
    outcomes on the engine's loop as soon as they are in."""

    def __call__(
        self,
        method: str,
        *args: Any,
        timeout: float,
        arrived: Callable[[list[RankOutcome[Any]]], None] | None = ...,
    ) -> Awaitable[list[RankOutcome[Any]]]: ...


class WorkerCalls:
    """Worker RPCs on every worker of every EngineCore, each bounded by the timeout it is
    sent with, and what their late answers mean for the engine."""

    def __init__(
        self, call_all: CallAll, call_each: CallEach, lost: Callable[[str], None], dead: Callable[[], bool]
    ) -> None:
        """`lost(cause)`: the engine is dead (called on the engine's loop); `dead()`: whether
        it died already."""
        self._call_all = call_all
        self._call_each = call_each
        self._lost = lost
        self._dead = dead
        # Whether the EngineCores have enginectl's utilities (Utility.WORKER_CALL); learnt on
        # the first worker call. A user's own scheduler on an engine whose workers run in
        # processes of their own leaves them without (server/weights/updates.py `prepare`).
        self._bounded: bool | None = None

    async def call(self, rpc: WorkerRpc, *args: Any, timeout: float) -> list[list[Any]]:
        """A worker RPC on every worker of every rank, bounded by `timeout` in each
        EngineCore (Utility.WORKER_CALL): per DP rank, one answer per worker. A call that
        outlived its timeout raises DEADLINE_EXCEEDED WORKER_TIMEOUT once its late answers
        were drained; if they never came, that EngineCore stopped its executor and the engine
        is dead from here on."""

        if not await self._has_worker_call():
            # vLLM's own collective_rpc with no timeout: the EngineCore waits for every answer,
            # so none can be late (every worker RPC answers in bounded time by construction).
            per_rank = await self._call_all(VllmUtility.COLLECTIVE_RPC.value, rpc.value, None, args, None)
            return [list(answers) for answers in per_rank]

        def arrived(answers: list[Any]) -> None:  # on the engine's loop
            calls = [read(WorkerCall, answer) for answer in answers]
            for c in calls:
                self._note_lost(c)

        answers = await self._call_all(
            Utility.WORKER_CALL.value, rpc.value, timeout, args, what=rpc.value, arrived=arrived
        )
        return [_answers(read(WorkerCall, answer)) for answer in answers]

    async def call_per_rank(self, rpc: WorkerRpc, *args: Any, timeout: float) -> list[RankOutcome[list[Any]]]:
        """A worker RPC rank by rank (EngineAdapter's `_call_each`): each EngineCore bounds it
        by QUICK_RPC_TIMEOUT_S (for RPCs whose workers answer at once, the group RPCs), the
        server waits `timeout` at most; a rank that fails or does not answer is named while the
        others' answers are kept."""

        if not await self._has_worker_call():  # as in `call`
            plain = await self._call_each(
                VllmUtility.COLLECTIVE_RPC.value, rpc.value, None, args, None, timeout=timeout
            )
            return [o.map(list) for o in plain]

        def arrived(outcomes: list[RankOutcome[Any]]) -> None:  # on the engine's loop
            for outcome in outcomes:
                if outcome.result is not None:
                    with contextlib.suppress(ValueError, TypeError):  # unreadable: that rank's RANK_ERROR
                        self._note_lost(read(WorkerCall, outcome.result))

        outcomes = await self._call_each(
            Utility.WORKER_CALL.value, rpc.value, QUICK_RPC_TIMEOUT_S, args, timeout=timeout, arrived=arrived
        )
        return [o.map(lambda answer: _answers(read(WorkerCall, answer))) for o in outcomes]

    async def _has_worker_call(self) -> bool:
        """Whether the EngineCores have Utility.WORKER_CALL (asked once, by a cheap utility of
        the same set: a scheduler that lacks one lacks them all)."""
        if self._bounded is None:
            try:
                await self._call_all(Utility.GENERATION_STATE.value)
                self._bounded = True
            except ControlPlaneError:
                if self._dead():
                    raise
                self._bounded = False
        return self._bounded

    def _note_lost(self, call: WorkerCall) -> None:
        """On the engine's loop, as soon as the answer is in: a late answer that never came
        means that EngineCore stopped its executor. The engine is dead, and this says why
        before vLLM's own signs of it (the EngineCore's next step fails) can."""
        if call.late is not None and not call.late.drained:
            self._lost(call.late.message)


def _answers(call: WorkerCall) -> list[Any]:
    """A rank's WorkerCall as its workers' answers, or the error of its late answer: ENGINE_DEAD
    when it never came (`WorkerCalls._note_lost`), else DEADLINE_EXCEEDED WORKER_TIMEOUT."""
    late = call.late
    if late is None:
        return call.answers
    if not late.drained:
        raise engine_dead(late.message)
    raise ControlPlaneError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        Reason.WORKER_TIMEOUT,
        late.message,
        metadata={"rpc": late.rpc, "timeout": f"{late.timeout:.3f}"},
    )


def engine_dead(message: str) -> ControlPlaneError:
    """UNAVAILABLE ENGINE_DEAD: the error of every call into an engine that died."""
    return ControlPlaneError(grpc.StatusCode.UNAVAILABLE, Reason.ENGINE_DEAD, message)
