"""UpdateGroups: the private process groups a trainer broadcasts weights through.

Runs in the `enginectl serve` process, on the control loop. Each group is a gloo (or NCCL)
group of the trainer (rank 0) and every worker of this engine, created by
InitWeightsUpdateGroup and used by UpdateWeightsFromDistributed; vLLM's own groups are never
touched (worker/weights/groups.py).

A name belongs to the last trainer that created it: an init under a name that exists, while no
update receives through it, is a trainer that restarted taking it over (SGLang's
init_weights_update_group replaces a group the same way). The workers leave the old group
first; the takeover is logged with who held the name since when, and counted
(docs/weights.md, "A trainer that restarts").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

import grpc
import structlog

from enginectl.common.host import is_loopback
from enginectl.contract.engine import Cause, RankFailure
from enginectl.contract.groups import Backend, GroupJoined, GroupSpec
from enginectl.server.errors import ControlPlaneError, Reason, invalid_field
from enginectl.server.limits import (
    DEFAULT_GROUP_TIMEOUT_S,
    MAX_GROUP_NAME_BYTES,
    MAX_GROUP_TIMEOUT_S,
    MAX_GROUPS,
    MAX_WORLD_SIZE,
)
from enginectl.server.weights.convert import parse_timeout
from enginectl.server.weights.engine_protocols import GroupEngine
from enginectl.server.weights.sources.ipc import ipc_available
from enginectl.server.worker_calls import RankOutcome
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

log = structlog.get_logger("enginectl.groups")

# InitWeightsUpdateGroup answers within its timeout plus this, whatever the load: the workers
# join on threads of their own, and the server stops asking once the timeout passed
# (docs/architecture.md, "Worker calls and their deadlines").
JOIN_MARGIN_S: Final = 2.0
# How often the server asks how the workers' joins stand: from 5 ms, doubling, to 100 ms.
JOIN_POLL_FIRST_S: Final = 0.005
JOIN_POLL_MAX_S: Final = 0.1

# Causes after which a group can not be trusted again: the server destroys it.
BREAKING_CAUSES = frozenset(
    c.value for c in (Cause.GROUP_TIMEOUT, Cause.STREAM_BROKEN, Cause.UPDATE_CANCELLED, Cause.GROUP_BROKEN)
)


def check_group_name(name: str, field: str = "group_name") -> None:
    if not name or len(name.encode()) > MAX_GROUP_NAME_BYTES or not all(c.isalnum() or c in "-_." for c in name):
        raise invalid_field(
            Reason.GROUP_NAME_INVALID, field, f"1-{MAX_GROUP_NAME_BYTES} bytes of letters, digits, '-', '_' or '.'"
        )


def check_master_reachable(address: str, remote_ranks: Mapping[int, str]) -> None:
    """FAILED_PRECONDITION MASTER_ADDRESS_LOOPBACK when `address` is a loopback address
    (`is_loopback`) while ranks run on other hosts (`remote_ranks`: dp_rank -> its host):
    their workers would look for the trainer's store on their own host and time out, after
    this host's workers joined. Refused before any worker joins."""
    if not remote_ranks or not is_loopback(address):
        return
    ranks = ", ".join(f"rank {rank} on {host}" for rank, host in sorted(remote_ranks.items()))
    raise ControlPlaneError(
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.MASTER_ADDRESS_LOOPBACK,
        f"master_address {address!r} is a loopback address, which the ranks on other hosts ({ranks}) can not "
        "reach the trainer at; use an address of the trainer's host that every node can reach",
        metadata={
            "master_address": address,
            "remote_ranks": ",".join(str(rank) for rank in sorted(remote_ranks)),
            "remote_hosts": ",".join(sorted(set(remote_ranks.values()))),
        },
    )


def backends() -> list[pb2.UpdateBackend.ValueType]:
    """The update backends this machine offers (NCCL only with CUDA, IPC only on Linux)."""
    found: list[pb2.UpdateBackend.ValueType] = [
        pb2.UPDATE_BACKEND_DISK,
        pb2.UPDATE_BACKEND_GLOO,
        pb2.UPDATE_BACKEND_TENSOR_STREAM,
    ]
    try:
        import torch

        if torch.cuda.is_available() and torch.distributed.is_nccl_available():
            found.insert(2, pb2.UPDATE_BACKEND_NCCL)
    except Exception:  # noqa: BLE001 - no torch CUDA: no NCCL
        pass
    if ipc_available():
        found.append(pb2.UPDATE_BACKEND_IPC)
    return found


class UpdateGroups:
    """The groups of one engine: created, being created, and in use by an update."""

    def __init__(
        self,
        engine: GroupEngine,
        on_takeover: Callable[[str], None] | None = None,
        *,
        remote_ranks: Mapping[int, str] = MappingProxyType({}),
    ) -> None:
        self._engine = engine
        self._remote_ranks = remote_ranks  # dp_rank -> host of the ranks on other hosts (the census)
        self._groups: dict[str, pb2.WeightsUpdateGroup] = {}
        self._created_by: dict[str, str] = {}  # who created each group (servicer_context.caller_of)
        self._pending: set[str] = set()
        self.in_use: set[str] = set()
        self._on_takeover = on_takeover  # hears "update_group" on every takeover (the metric)

    def __contains__(self, name: str) -> bool:
        return name in self._groups

    async def init(self, request: pb2.InitWeightsUpdateGroupRequest, by: str = "") -> pb2.WeightsUpdateGroup:
        """Create the group `request` names, or take its name over (module docstring); `by`:
        who asks. The caller checked that no update receives through it (WeightUpdates)."""
        check_group_name(request.group_name)
        if not request.master_address or len(request.master_address.encode()) > 253:
            raise invalid_field(
                Reason.MASTER_ADDRESS_INVALID, "master_address", "a host name or address, at most 253 bytes"
            )
        if not 0 < request.master_port < 65536:
            raise invalid_field(Reason.MASTER_ADDRESS_INVALID, "master_port", "in 1..65535")
        workers = self._engine.info.num_workers
        if request.world_size > MAX_WORLD_SIZE:
            raise invalid_field(Reason.GROUP_SIZE_INVALID, "world_size", f"at most {MAX_WORLD_SIZE}")
        if request.rank_offset < 1 or request.world_size < request.rank_offset + workers:
            raise invalid_field(
                Reason.GROUP_SIZE_INVALID,
                "world_size",
                f"rank_offset must be >= 1 (the trainer is rank 0) and world_size >= "
                f"rank_offset + {workers} (this engine's workers)",
            )
        if request.backend not in (pb2.GROUP_BACKEND_GLOO, pb2.GROUP_BACKEND_NCCL):
            raise invalid_field(Reason.GROUP_BACKEND_REQUIRED, "backend", "GLOO or NCCL")
        timeout = parse_timeout(
            "timeout",
            request.timeout,
            request.HasField("timeout"),
            default=DEFAULT_GROUP_TIMEOUT_S,
            maximum=MAX_GROUP_TIMEOUT_S,
        )
        if request.backend == pb2.GROUP_BACKEND_NCCL and pb2.UPDATE_BACKEND_NCCL not in backends():
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.BACKEND_UNAVAILABLE,
                "NCCL needs CUDA GPUs; this engine has none (use GLOO or the tensor stream)",
            )
        if self._remote_ranks:  # a name may resolve slowly: off the control loop
            await asyncio.to_thread(check_master_reachable, request.master_address, self._remote_ranks)
        name = request.group_name
        if name in self._pending:
            raise ControlPlaneError(
                grpc.StatusCode.ALREADY_EXISTS,
                Reason.GROUP_EXISTS,
                f"group {name!r} is being created (or left) by another call; init again once that call answered",
            )
        if name in self.in_use:  # WeightUpdates names the update first; this is the last word
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.GROUP_IN_USE,
                f"an update is receiving through {name!r}; CancelOperation on it frees the name",
            )
        replaced = self._groups.get(name)
        if replaced is None and len(self._groups) + len(self._pending) >= MAX_GROUPS:
            raise ControlPlaneError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.TOO_MANY_GROUPS,
                f"{MAX_GROUPS} groups exist; destroy one first",
            )
        spec = GroupSpec(
            name=name,
            master_address=request.master_address,
            master_port=request.master_port,
            rank_offset=request.rank_offset,
            world_size=request.world_size,
            timeout=timeout,
            backend=Backend.NCCL if request.backend == pb2.GROUP_BACKEND_NCCL else Backend.GLOO,
            first_worker=self._engine.info.layout.first_worker,  # ranks from rank_offset on, this server's
        )
        self._pending.add(name)  # from here until it is created, another init of `name` waits its turn
        try:
            if replaced is not None:
                await self._take_over(replaced, by)
            outcomes = await self._join(spec)
        except BaseException:
            self._leave(name)
            raise
        failure = _join_failure(name, timeout, outcomes)
        if failure is not None:
            self._leave(name)  # the members that did join leave again; the others give up
            raise failure
        self._pending.discard(name)
        group = pb2.WeightsUpdateGroup(
            group_name=name,
            backend=request.backend,
            master_address=request.master_address,
            master_port=request.master_port,
            world_size=request.world_size,
            rank_offset=request.rank_offset,
            num_engine_ranks=workers,
        )
        group.create_time.FromNanoseconds(time.time_ns())
        self._groups[name] = group
        self._created_by[name] = by
        log.info("update group created", group=name, backend=spec.backend.value, world_size=request.world_size)
        return group

    async def _take_over(self, replaced: pb2.WeightsUpdateGroup, by: str) -> None:
        """A trainer that restarted creates its group again: every worker leaves the old one
        (its trainer is gone, or is about to lose it), logged and counted."""
        name = replaced.group_name
        previous = self._created_by.get(name, "")
        await self.drop(name)
        log.warning(
            "update group taken over",
            group=name,
            previous_create_time=replaced.create_time.ToJsonString(),
            previous_caller=previous,
            previous_master=f"{replaced.master_address}:{replaced.master_port}",
            caller=by,
        )
        if self._on_takeover is not None:
            self._on_takeover("update_group")

    async def _join(self, spec: GroupSpec) -> list[RankOutcome[list[GroupJoined]]]:
        """Every worker joins `spec` on its own thread; ask how they stand until every rank
        ended its join, or the timeout (plus JOIN_MARGIN_S) passed: a rank still joining then
        is a RANK_TIMEOUT. Each call to the engine is bounded by the time left."""
        loop = asyncio.get_running_loop()
        end = loop.time() + spec.timeout + JOIN_MARGIN_S

        def left() -> float:
            return max(end - loop.time(), 0.0)

        outcomes = {o.dp_rank: o for o in await self._engine.init_group(spec, timeout=left())}
        interval = JOIN_POLL_FIRST_S
        while joining := [rank for rank, o in outcomes.items() if _joining(o)]:
            if left() <= 0:
                for rank in joining:
                    outcomes[rank] = RankOutcome(
                        rank, failure=RankFailure.RANK_TIMEOUT, message=f"still joining after {spec.timeout:.3f}s"
                    )
                break
            await asyncio.sleep(min(interval, left()))  # the workers' threads join meanwhile
            interval = min(interval * 2, JOIN_POLL_MAX_S)
            for state in await self._engine.group_join_state(spec.name, timeout=left()):
                if state.dp_rank in joining:  # a poll that ran out of time is that rank's RANK_TIMEOUT
                    outcomes[state.dp_rank] = state
        return [outcomes[rank] for rank in sorted(outcomes)]

    def _leave(self, name: str) -> None:
        """Every worker leaves `name` or gives up joining it, in the background (each answers at
        once, but the caller has been answered already); the name stays taken until then."""

        async def leave() -> None:
            try:
                await self._engine.destroy_group(name)
            except Exception:  # noqa: BLE001 - an engine that died answers nothing more
                log.warning("leaving an update group that was not created failed", group=name)
            finally:
                self._pending.discard(name)

        self._pending.add(name)
        asyncio.ensure_future(leave())

    async def destroy(self, request: pb2.DestroyWeightsUpdateGroupRequest) -> bool:
        check_group_name(request.group_name)
        name = request.group_name
        if name in self.in_use:
            raise ControlPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.GROUP_IN_USE,
                f"an update is receiving through {name!r}; cancel it first",
            )
        if name not in self._groups:
            if request.allow_missing:
                return False
            raise ControlPlaneError(grpc.StatusCode.NOT_FOUND, Reason.GROUP_NOT_FOUND, f"no update group {name!r}")
        await self.drop(name)
        return True

    async def drop(self, name: str) -> None:
        """Forget `name` and have every worker leave it."""
        self._groups.pop(name, None)
        self._created_by.pop(name, None)
        await self._engine.destroy_group(name)


def _joining(outcome: RankOutcome[list[GroupJoined]]) -> bool:
    return outcome.failure is None and any(worker.joining for worker in outcome.result or ())


def _join_failure(
    name: str, timeout: float, outcomes: list[RankOutcome[list[GroupJoined]]]
) -> ControlPlaneError | None:
    """None when every worker of every rank joined; else GROUP_TIMEOUT when a rank or a
    worker ran out of time, GROUP_INIT_FAILED otherwise, naming each rank that did not join."""
    timed_out, problems = False, []
    for outcome in outcomes:
        if outcome.failure is not None:
            timed_out |= outcome.failure == RankFailure.RANK_TIMEOUT
            problems.append(f"rank {outcome.dp_rank}: {outcome.message}")
            continue
        for worker in outcome.result or ():
            if worker.failure:
                timed_out |= worker.failure == Reason.GROUP_TIMEOUT
                problems.append(f"rank {outcome.dp_rank}: {worker.message}")
    if not problems:
        return None
    message = "; ".join(problems)
    if timed_out:
        return ControlPlaneError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            Reason.GROUP_TIMEOUT,
            f"not every member joined group {name!r} within {timeout:.3f}s: {message}",
        )
    return ControlPlaneError(
        grpc.StatusCode.UNAVAILABLE, Reason.GROUP_INIT_FAILED, f"joining group {name!r} failed: {message}"
    )
