"""The fleet as one vLLM weight-sync client: a trainer-side transfer engine feeds every server.

Runs in the trainer process, mixed into AsyncFleet (fleet.py); `Fleet` has the blocking twins.
vLLM's trainer-side engines (`WeightTransferTrainerFactory.trainer_init(..., client=...)`)
drive ONE server through the four steps of its `VLLMWeightSyncClient` protocol. Passed as
that client, the fleet runs each step on every server at once (docs/weights.md, "The fleet
over a transfer engine"):

- `init_weight_transfer_engine(info)`: one init per server, each at its own rank offset in
  one group that spans the trainer and every server's workers (`transfer_world_size()` is
  the group's size: the trainer engine's `world_size`). `info` is the engine's own init info,
  as it builds it for one server: its `rank_offset` is shifted by the workers of the servers
  before each one, so any engine whose init info has `rank_offset` (enginectl's `gloo`,
  vLLM's `nccl`) fits.
- `start_weight_update()`: a round that stages (`stage_only`) on every server, fenced by the
  etag each server's version has now; nothing is paused and no model is touched.
- `update_weights(info)`: each batch to every server, received beside the trainer's ONE
  broadcast.
- `finish_weight_update(version)`: every server's staged set, as the fleet's `last_stage`;
  `commit()` then applies it exactly as a stage from disk or a broadcast (strict: one pause
  across the fleet), with the same rules: any failure before the finish cancels every round
  and discards every set (FleetStageError: no server changed), and a commit that fails after
  writing began leaves that server quarantined until `repair()`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from google.protobuf import json_format, struct_pb2

from enginectl.client.errors import EnginectlError
from enginectl.client.fleet_types import FleetError, FleetStage, FleetStageError, ServerOutcome, stage_outcome
from enginectl.client.trainer_requests import GRACE_S, duration
from enginectl.client.trainer_types import UpdateOperation
from enginectl.weights.v1 import weight_update_service_pb2 as pb2
from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc

INIT_TIMEOUT_S = 60.0
T = TypeVar("T")


class _Fleet(Protocol):
    """What the mixin uses of AsyncFleet (fleet.py, which imports this module)."""

    targets: list[str]
    _updates: dict[str, pb2_grpc.WeightUpdateServiceStub]

    async def _each(
        self, call: Callable[[str, Any], Awaitable[T]], targets: Sequence[str] | None = None
    ) -> dict[str, T | EnginectlError]: ...

    async def _etags(self) -> dict[str, str]: ...

    async def _staged_or_discard(
        self, version: str | None, outcomes: dict[str, ServerOutcome], etags: dict[str, str]
    ) -> FleetStage: ...

    async def _discard_all(self, outcomes: dict[str, ServerOutcome]) -> None: ...

    async def _stage_results(
        self, started: dict[str, UpdateOperation | EnginectlError], progress: bool = False
    ) -> dict[str, ServerOutcome]: ...


@dataclass
class _Round:
    """The open round: each server's Operation, and the etags it is fenced with."""

    operations: dict[str, UpdateOperation]
    etags: dict[str, str]


class FleetTransferMixin:
    """vLLM's four steps over every server of the fleet (module docstring). Round options:
    `transfer_timeout` (the whole round, per server; None: the server's default) and
    `transfer_step_timeout` (the longest wait for the trainer's next step)."""

    transfer_timeout: float | None = None
    transfer_step_timeout: float | None = None
    _transfer_round: _Round | None = None

    def _fleet(self) -> _Fleet:
        return cast(_Fleet, self)

    async def transfer_world_size(self) -> int:
        """The group's size: the trainer (rank 0) and every server's workers."""
        return 1 + (await self._worker_offsets())[1]

    async def _worker_offsets(self) -> tuple[dict[str, int], int]:
        """How many workers come before each server's, in target order, and all of them
        (also the fleet's own group: fleet.py `init_weights_update_group`)."""
        fleet = self._fleet()
        infos = await fleet._each(lambda _, c: c.get_server_info())
        failed = {t: ServerOutcome(t, i) for t, i in infos.items() if isinstance(i, EnginectlError)}
        if failed:
            raise FleetError("could not read every server", failed)
        offsets, before = {}, 0
        for target in fleet.targets:
            offsets[target] = before
            before += infos[target].num_workers  # type: ignore[union-attr]
        return offsets, before

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float = INIT_TIMEOUT_S) -> None:
        """Every server's transfer engine joins the trainer's group, at its own rank offset.
        Raises FleetError (the servers that joined are shut down again) unless all did."""
        fleet = self._fleet()
        offsets, _ = await self._worker_offsets()
        base = int(init_info.get("rank_offset", 1))

        async def init(target: str, client: Any) -> Any:
            info = struct_pb2.Struct()
            info.update(dict(init_info, rank_offset=base + offsets[target]))
            request = pb2.InitWeightTransferEngineRequest(init_info=info, timeout=duration(timeout))
            return await client.connection.unary(
                fleet._updates[target].InitWeightTransferEngine, request, timeout + GRACE_S
            )

        answers = await fleet._each(init)
        failed = {t: ServerOutcome(t, a) for t, a in answers.items() if isinstance(a, EnginectlError)}
        if failed:
            await self._shutdown([t for t in answers if t not in failed])
            raise FleetError("not every server's transfer engine joined the group", failed)

    async def start_weight_update(self) -> None:
        """A staging round on every server (see the module docstring). Raises FleetStageError
        (the rounds that started are cancelled) unless every server started one."""
        fleet = self._fleet()
        if self._transfer_round is not None:
            raise RuntimeError("a round is open: finish_weight_update first")
        etags = await fleet._etags()

        async def start(target: str, client: Any) -> UpdateOperation:
            request = pb2.StartWeightUpdateRequest(etag=etags[target], stage_only=True)
            if self.transfer_timeout is not None:
                request.timeout.CopyFrom(duration(self.transfer_timeout))
            if self.transfer_step_timeout is not None:
                request.step_timeout.CopyFrom(duration(self.transfer_step_timeout))
            return UpdateOperation.from_proto(
                await client.connection.unary(fleet._updates[target].StartWeightUpdate, request, None)
            )

        started = await fleet._each(start)
        operations = {t: op for t, op in started.items() if not isinstance(op, EnginectlError)}
        if len(operations) < len(started):
            outcomes = await self._end_rounds(operations)
            outcomes.update({t: ServerOutcome(t, e) for t, e in started.items() if isinstance(e, EnginectlError)})
            raise FleetStageError("a server refused the round; nothing was sent, no server changed", outcomes)
        self._transfer_round = _Round(operations, etags)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One batch on every server (each receives the trainer's one broadcast). Raises
        FleetStageError (every round cancelled, every set discarded) unless all received it."""
        fleet, round_ = self._fleet(), self._open()
        value = struct_pb2.Value()
        json_format.ParseDict(cast(Any, update_info), value)

        async def send(target: str, client: Any) -> Any:
            request = pb2.UpdateWeightsRequest(name=round_.operations[target].name, update_info=value)
            return await client.connection.unary(fleet._updates[target].UpdateWeights, request, None)

        answers = await fleet._each(send)
        failed = {t: ServerOutcome(t, a) for t, a in answers.items() if isinstance(a, EnginectlError)}
        if failed:
            self._transfer_round = None
            outcomes = await self._end_rounds(round_.operations)
            raise FleetStageError("a batch failed on a server; every staged set was discarded", {**outcomes, **failed})

    async def finish_weight_update(self, weight_version: str | None = None) -> FleetStage:
        """Every server's round ends in its staged set (declared `weight_version` at the
        commit); the fleet's `last_stage`, or FleetStageError with every set discarded."""
        fleet, round_ = self._fleet(), self._open()
        self._transfer_round = None

        async def finish(target: str, client: Any) -> UpdateOperation:
            request = pb2.FinishWeightUpdateRequest(name=round_.operations[target].name, etag=round_.etags[target])
            if weight_version is not None:
                request.weight_version = weight_version
            bound = (self.transfer_timeout or client.config.timeout) + GRACE_S
            return UpdateOperation.from_proto(
                await client.connection.unary(fleet._updates[target].FinishWeightUpdate, request, bound)
            )

        answers = await fleet._each(finish)
        outcomes = {t: stage_outcome(t, a) for t, a in answers.items()}
        if not all(o.ok for o in outcomes.values()):  # a round the finish left open ends too
            await self._end_rounds({t: round_.operations[t] for t, o in outcomes.items() if not o.ok})
        return await fleet._staged_or_discard(weight_version, outcomes, round_.etags)

    async def shutdown_weight_transfer_engine(self) -> None:
        """Every server leaves the group (a round still open is cancelled first)."""
        round_, self._transfer_round = self._transfer_round, None
        if round_ is not None:
            await self._end_rounds(round_.operations)
        await self._shutdown(self._fleet().targets)

    def _open(self) -> _Round:
        if self._transfer_round is None:
            raise RuntimeError("no open round: start_weight_update first")
        return self._transfer_round

    async def _end_rounds(self, operations: dict[str, UpdateOperation]) -> dict[str, ServerOutcome]:
        """Cancel the rounds `operations` (by target), wait for them, and discard what any of
        them staged (one that finished before its cancel); each server's outcome."""
        fleet = self._fleet()
        await fleet._each(lambda t, c: c.cancel_operation(operations[t].name), list(operations))
        outcomes = await fleet._stage_results(dict(operations))
        await fleet._discard_all(outcomes)
        return outcomes

    async def _shutdown(self, targets: list[str]) -> None:
        fleet = self._fleet()
        request = pb2.ShutdownWeightTransferEngineRequest()
        await fleet._each(
            lambda t, c: c.connection.unary(fleet._updates[t].ShutdownWeightTransferEngine, request, None), targets
        )
