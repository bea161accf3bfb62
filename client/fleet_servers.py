"""The fleet's servers: a trainer client per server, and the fan-out every fleet step is made of.

Runs in the trainer process. `FleetServers` holds one AsyncTrainerClient per target and runs a
call on every server at once, each server's error as its answer (`each`). On it stand the
pieces the fleet's stages share, whichever way the tensors travel: the etags a commit is fenced
with, every server's rank offset in a fleet-wide group, waiting for stage Operations, and the
rule that a stage is the fleet's only if every server staged (else every set is discarded).
AsyncFleet (fleet.py) builds one and hands it to FleetTransfer (fleet_transfer.py): both call
the servers through it and through each server's AsyncTrainerClient, never a raw stub.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, Unpack

from enginectl.client.client import ChannelOptions
from enginectl.client.errors import EnginectlError
from enginectl.client.fleet_types import FleetError, FleetStage, FleetStageError, ServerOutcome, stage_outcome
from enginectl.client.progress import FleetProgress
from enginectl.client.rank_ranges import group_windows
from enginectl.client.trainer import AsyncTrainerClient
from enginectl.client.trainer_operations import POLL_S
from enginectl.client.trainer_types import ServerInfo, UpdateOperation

T = TypeVar("T")


class FleetServers:
    """Every server of a fleet, in target order, and the fleet's last stage."""

    def __init__(self, targets: Sequence[str], **config: Unpack[ChannelOptions]) -> None:
        self.targets = list(targets)
        self.clients = {t: AsyncTrainerClient(t, **config) for t in self.targets}
        self.last_stage: FleetStage | None = None

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)

    async def each(
        self, call: Callable[[str, AsyncTrainerClient], Awaitable[T]], targets: Sequence[str] | None = None
    ) -> dict[str, T | EnginectlError]:
        """`call` on every server (or `targets`) at once; an EnginectlError is its answer."""
        chosen = self.targets if targets is None else list(targets)
        answers = await asyncio.gather(*(call(t, self.clients[t]) for t in chosen), return_exceptions=True)
        out: dict[str, T | EnginectlError] = {}
        for target, answer in zip(chosen, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, EnginectlError):
                raise answer
            out[target] = answer
        return out

    async def etags(self) -> dict[str, str]:
        """Every server's etag now (the fence of a commit of what is staged next)."""
        read = await self.each(lambda _, c: c.get_weight_version())
        failed = {t: ServerOutcome(t, v) for t, v in read.items() if isinstance(v, EnginectlError)}
        if failed:
            raise FleetStageError("could not read every server's version; nothing was staged", failed)
        return {t: v.etag for t, v in read.items() if not isinstance(v, EnginectlError)}

    async def infos(self) -> dict[str, ServerInfo]:
        """Every server's GetServerInfo, by target; FleetError if one can not be read."""
        infos = await self.each(lambda _, c: c.get_server_info())
        failed = {t: ServerOutcome(t, i) for t, i in infos.items() if isinstance(i, EnginectlError)}
        if failed:
            raise FleetError("could not read every server", failed)
        return {t: i for t, i in infos.items() if isinstance(i, ServerInfo)}

    async def worker_offsets(self, infos: dict[str, ServerInfo] | None = None) -> tuple[dict[str, int], int]:
        """How many workers come before each server's, in target order, and all of them: the
        ranks of a group that spans the trainer and every server's workers (from `infos`, else
        read now)."""
        infos = infos if infos is not None else await self.infos()
        # Each server's managed workers only: under hybrid load balancing a server holds its
        # node's ranks (client/rank_ranges.py; docs/multinode.md, "One server per node").
        windows, total = group_windows({t: infos[t].num_workers for t in self.targets}, first=0)
        return {t: w.start for t, w in windows.items()}, total

    async def stage_results(
        self, started: dict[str, UpdateOperation | EnginectlError], progress: bool = False
    ) -> dict[str, ServerOutcome]:
        """Wait for every stage Operation (in POLL_S slices, drawing progress, with
        `progress`); each server's outcome."""
        outcomes = {t: ServerOutcome(t, op) for t, op in started.items() if isinstance(op, EnginectlError)}
        running = {t: op for t, op in started.items() if not isinstance(op, EnginectlError)}
        bar = FleetProgress("staging") if progress else None
        try:
            while running:
                polled = await self.each(
                    lambda t, c: c.wait_operation(running[t].name, POLL_S if bar else None), list(running)
                )
                for target, op in polled.items():
                    if isinstance(op, EnginectlError) or op.done:
                        outcomes[target] = stage_outcome(target, op)
                        running.pop(target)
                    else:
                        running[target] = op
                if bar is not None:
                    bar.update({t: op.progress for t, op in polled.items() if not isinstance(op, EnginectlError)})
        finally:
            if bar is not None:
                bar.close()
        return {t: outcomes[t] for t in started}

    async def staged(
        self, version: str | None, outcomes: dict[str, ServerOutcome], etags: dict[str, str]
    ) -> FleetStage:
        """The fleet's stage (now `last_stage`) if every server staged; else every set
        discarded and FleetStageError raised."""
        if not all(o.ok for o in outcomes.values()):
            await self.discard_all(outcomes)
            raise FleetStageError("a stage failed; every staged set was discarded, no server changed", outcomes)
        self.last_stage = FleetStage(version, outcomes, etags)
        return self.last_stage

    async def discard_all(self, outcomes: dict[str, ServerOutcome]) -> None:
        """Drop every set `outcomes` name (each on its own server)."""
        staged = {t: o.staged.name for t, o in outcomes.items() if o.staged is not None}
        await self.each(lambda t, c: c.discard_staged_weights(staged[t], allow_missing=True), list(staged))
