"""The broadcast master address a trainer offers its servers' workers: refused when they could
not reach it (docs/multinode.md, "A fleet across hosts"). Used by every client path that hosts
a group for servers to join: TrainerClient.init_weights_update_group, the Fleet's group, and
vLLM's transfer engine init through a TrainerClient or a Fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc

from enginectl.client.errors import FailedPreconditionError, Reason
from enginectl.client.trainer_types import ServerInfo
from enginectl.common.host import host_identity, is_loopback, route_to


async def refuse_loopback_master(master_address: str, servers: Mapping[str, ServerInfo]) -> None:
    """FailedPreconditionError MASTER_ADDRESS_LOOPBACK when `master_address` is a loopback
    address and a rank of one of `servers` (target -> its GetServerInfo) runs on another host
    than this process: that rank's workers would look for this trainer's store on their own
    host and the join would end GROUP_TIMEOUT, after the others joined. Ranks are placed by
    the servers' census (RankInfo.host_id against this host's; docs/multinode.md). An empty
    address is left to the server to refuse."""
    here = host_identity().host_id
    elsewhere = [
        f"{f'{target}: ' if target else ''}rank {r.dp_rank} on {r.host}"
        for target, info in servers.items()
        for r in info.ranks
        if r.host_id and r.host_id != here
    ]
    if not master_address or not elsewhere or not await asyncio.to_thread(is_loopback, master_address):
        return
    remote = [t for t, info in servers.items() if t and any(r.host_id and r.host_id != here for r in info.ranks)]
    routes = [a for a in await asyncio.gather(*(asyncio.to_thread(route_to, t) for t in remote)) if a]
    hint = f"master_address={routes[0]!r} (this host's address toward {remote[0]!r}) or " if routes else ""
    raise FailedPreconditionError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"master_address {master_address!r} is a loopback address, which ranks on other hosts "
        f"({', '.join(elsewhere)}) can not reach this trainer at; pass {hint}an address of this host "
        "every node reaches",
        Reason.MASTER_ADDRESS_LOOPBACK,
        {"master_address": master_address, **({"suggested_master_address": routes[0]} if routes else {})},
    )
