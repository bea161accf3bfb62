"""The fleet as one vLLM weight-sync client: a trainer-side transfer engine feeds every server.

Runs in the trainer process. `FleetTransfer` is built by AsyncFleet (fleet.py) on the fleet's
servers (fleet_servers.py), and AsyncFleet forwards the steps to it; `Fleet` has the blocking
twins.

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

Each step runs on every server through that server's AsyncTrainerClient, whose own steps
(trainer_transfer.py `TransferRounds`) are the one way a round runs on the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enginectl.client.errors import EnginectlError
from enginectl.client.fleet_servers import FleetServers
from enginectl.client.fleet_types import FleetError, FleetStage, FleetStageError, ServerOutcome, stage_outcome
from enginectl.client.master_address import refuse_loopback_master
from enginectl.client.trainer_transfer import RoundOptions
from enginectl.client.trainer_types import UpdateOperation

INIT_TIMEOUT_S = 60.0


@dataclass
class _Round:
    """The open round: each server's Operation, and the etags it is fenced with."""

    operations: dict[str, UpdateOperation]
    etags: dict[str, str]


class FleetTransfer:
    """vLLM's four steps over every server of the fleet (module docstring)."""

    def __init__(self, servers: FleetServers) -> None:
        self._servers = servers
        self._round: _Round | None = None

    async def transfer_world_size(self) -> int:
        """The group's size: the trainer (rank 0) and every server's workers."""
        return 1 + (await self._servers.worker_offsets())[1]

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float = INIT_TIMEOUT_S) -> None:
        """Every server's transfer engine joins the trainer's group, at its own rank offset.
        Raises FleetError (the servers that joined are shut down again) unless all did;
        FailedPreconditionError MASTER_ADDRESS_LOOPBACK, before any server is asked, when the
        info's master_address is a loopback address and a server's rank runs on another host."""
        infos = await self._servers.infos()
        await refuse_loopback_master(str(init_info.get("master_address", "")), infos)
        offsets, _ = await self._servers.worker_offsets(infos)
        base = int(init_info.get("rank_offset", 1))
        answers = await self._servers.each(
            lambda t, c: c.init_weight_transfer_engine(dict(init_info, rank_offset=base + offsets[t]), timeout=timeout)
        )
        failed = {t: ServerOutcome(t, a) for t, a in answers.items() if isinstance(a, EnginectlError)}
        if failed:
            await self._shutdown([t for t in answers if t not in failed])
            raise FleetError("not every server's transfer engine joined the group", failed)

    async def start_weight_update(self, timeout: float | None = None, step_timeout: float | None = None) -> None:
        """A staging round on every server (see the module docstring): `timeout` bounds the
        whole round, per server, and `step_timeout` the wait for the trainer's next step
        (None: the server's defaults). Raises FleetStageError (the rounds that started are
        cancelled) unless every server started one."""
        if self._round is not None:
            raise RuntimeError("a round is open: finish_weight_update first")
        etags = await self._servers.etags()
        started = await self._servers.each(
            lambda t, c: c.start_weight_update(
                RoundOptions(timeout=timeout, step_timeout=step_timeout, etag=etags[t], stage_only=True)
            )
        )
        operations = {t: op for t, op in started.items() if not isinstance(op, EnginectlError)}
        if len(operations) < len(started):
            outcomes = await self._end_rounds(operations)
            outcomes.update({t: ServerOutcome(t, e) for t, e in started.items() if isinstance(e, EnginectlError)})
            raise FleetStageError("a server refused the round; nothing was sent, no server changed", outcomes)
        self._round = _Round(operations, etags)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One batch on every server (each receives the trainer's one broadcast). Raises
        FleetStageError (every round cancelled, every set discarded) unless all received it."""
        round_ = self._open()
        answers = await self._servers.each(lambda _, c: c.update_weights(update_info))
        failed = {t: ServerOutcome(t, a) for t, a in answers.items() if isinstance(a, EnginectlError)}
        if failed:
            self._round = None
            outcomes = await self._end_rounds(round_.operations)
            raise FleetStageError("a batch failed on a server; every staged set was discarded", {**outcomes, **failed})

    async def finish_weight_update(self, weight_version: str | None = None) -> FleetStage:
        """Every server's round ends in its staged set (declared `weight_version` at the
        commit); the fleet's `last_stage`, or FleetStageError with every set discarded."""
        round_ = self._open()
        self._round = None
        answers = await self._servers.each(lambda _, c: c.finish_weight_update(weight_version))
        outcomes = {t: stage_outcome(t, a) for t, a in answers.items()}
        if not all(o.ok for o in outcomes.values()):  # a round the finish left open ends too
            await self._end_rounds({t: round_.operations[t] for t, o in outcomes.items() if not o.ok})
        return await self._servers.staged(weight_version, outcomes, round_.etags)

    async def shutdown_weight_transfer_engine(self) -> None:
        """Every server leaves the group (a round still open is cancelled first)."""
        round_, self._round = self._round, None
        if round_ is not None:
            await self._end_rounds(round_.operations)
        await self._shutdown(self._servers.targets)

    def _open(self) -> _Round:
        if self._round is None:
            raise RuntimeError("no open round: start_weight_update first")
        return self._round

    async def _end_rounds(self, operations: dict[str, UpdateOperation]) -> dict[str, ServerOutcome]:
        """Cancel the rounds `operations` (by target), wait for them, and discard what any of
        them staged (one that finished before its cancel); each server's outcome."""
        await self._servers.each(lambda t, c: c.cancel_operation(operations[t].name), list(operations))
        outcomes = await self._servers.stage_results(dict(operations))
        await self._servers.discard_all(outcomes)
        return outcomes

    async def _shutdown(self, targets: list[str]) -> None:
        await self._servers.each(lambda _, c: c.shutdown_weight_transfer_engine(), targets)
