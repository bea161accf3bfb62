"""Transfer rounds: the steps of vLLM's weight-sync client, run by the trainer client.

Runs in the trainer process. vLLM's trainer-side transfer engines drive a server through the
methods of its `VLLMWeightSyncClient` protocol: `init_weight_transfer_engine(init_info)` once,
then per round `start_weight_update()`, `update_weights(update_info)` for each batch (received
beside the engine's own broadcast) and `finish_weight_update(weight_version)`, and
`shutdown_weight_transfer_engine()`. Each round is an enginectl update: a version recorded only
on success, an etag fence, the pause mode, deadlines, the partial rule (docs/weights.md, "vLLM's
weight-transfer engines").

`TransferRounds` runs those steps on one server, over the trainer's connection; it is the one
way a round runs on the client. `RoundOptions` is how a round runs (pause mode, timeouts,
fence, request id, stage_only). AsyncTrainerClient (client/trainer.py) holds one and forwards
the steps to it (TrainerClient has them blocking); WeightSyncClient (transfer_client.py) is
their blocking twin with its round options bound, and the fleet (fleet_transfer.py) runs them
on every server through each server's AsyncTrainerClient. Imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from google.protobuf import json_format, struct_pb2

from enginectl.client.client import Connection
from enginectl.client.master_address import refuse_loopback_master
from enginectl.client.trainer_requests import GRACE_S, duration, parse_pause_mode
from enginectl.client.trainer_types import ServerInfo, UpdateOperation, UpdateResult
from enginectl.weights.v1 import weight_update_service_pb2 as pb2

if TYPE_CHECKING:
    from enginectl.weights.v1 import weight_update_service_pb2_grpc as pb2_grpc


@dataclass(frozen=True)
class RoundOptions:
    """How a transfer round runs: its pause mode; `timeout` bounds the whole round and
    `step_timeout` the wait for the trainer's next step (None: the server's defaults); `etag`
    fences its start and, unless the finish names one, its finish; `request_id` names its
    start. `stage_only`: the round stages (nothing paused or applied; see
    commit_staged_weights)."""

    pause_mode: str = "keep"
    timeout: float | None = None
    step_timeout: float | None = None
    etag: str | None = None
    request_id: str | None = None
    stage_only: bool = False

    def request(self) -> pb2.StartWeightUpdateRequest:
        """The StartWeightUpdateRequest of a round with these options."""
        request = pb2.StartWeightUpdateRequest(
            etag=self.etag or "",
            request_id=self.request_id or "",
            pause_mode=parse_pause_mode(self.pause_mode),
            stage_only=self.stage_only,
        )
        if self.timeout is not None:
            request.timeout.CopyFrom(duration(self.timeout))
        if self.step_timeout is not None:
            request.step_timeout.CopyFrom(duration(self.step_timeout))
        return request


class TransferRounds:
    """vLLM's weight-transfer steps on one server. A server runs one round at a time: the
    steps after a start go to the round it started (until the next start)."""

    def __init__(self, connection: Connection, stub: pb2_grpc.WeightUpdateServiceStub) -> None:
        self._connection, self._stub = connection, stub
        # The round the steps go to: its Operation and the options it started with (its etag
        # fences the finish, its timeout bounds the finish's answer). No Operation before the
        # first start: the server refuses the steps.
        self._round: tuple[str, RoundOptions] = ("", RoundOptions())

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout: float | None = None) -> None:
        """The server's transfer engine joins the trainer engine's group as `init_info` (the
        trainer engine's own) says; `timeout` bounds the join on the server (None: its
        default). Returns once every worker joined. FailedPreconditionError
        MASTER_ADDRESS_LOOPBACK, before the server is asked, when the info's master_address is
        a loopback address and a rank of the server runs on another host than this process."""
        served = await self._connection.unary(self._stub.GetServerInfo, pb2.GetServerInfoRequest(), None)
        servers = {self._connection.config.target: ServerInfo.from_proto(served)}
        await refuse_loopback_master(str(init_info.get("master_address", "")), servers)
        info = struct_pb2.Struct()
        info.update(init_info)
        request = pb2.InitWeightTransferEngineRequest(init_info=info)
        if timeout is not None:
            request.timeout.CopyFrom(duration(timeout))
        bound = None if timeout is None else timeout + GRACE_S
        await self._connection.unary(self._stub.InitWeightTransferEngine, request, bound)

    async def start_weight_update(self, options: RoundOptions | None = None) -> UpdateOperation:
        """Start a round with `options` (None: the defaults: KEEP, the server's timeouts, no
        fence). Returns the round's Operation, running."""
        options = options or RoundOptions()
        op = await self._connection.unary(self._stub.StartWeightUpdate, options.request(), None)
        started = UpdateOperation.from_proto(op)
        self._round = (started.name, options)
        return started

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One batch of the round (the trainer engine's update info: names, dtypes, shapes),
        received by the server's workers beside the trainer engine's broadcast."""
        value = struct_pb2.Value()
        json_format.ParseDict(cast(Any, update_info), value)
        request = pb2.UpdateWeightsRequest(name=self._round[0], update_info=value)
        await self._connection.unary(self._stub.UpdateWeights, request, None)

    async def finish_weight_update(self, weight_version: str | None = None, *, etag: str | None = None) -> UpdateResult:
        """End the round and declare `weight_version` on success (fenced by `etag`, by default
        the start's). Returns its UpdateResult (a staging round's names its staged set);
        raises the round's error."""
        name, options = self._round
        request = pb2.FinishWeightUpdateRequest(name=name, etag=etag if etag is not None else options.etag or "")
        if weight_version is not None:
            request.weight_version = weight_version
        bound = (options.timeout or self._connection.config.timeout) + GRACE_S
        op = await self._connection.unary(self._stub.FinishWeightUpdate, request, bound)
        return UpdateOperation.from_proto(op).result()

    async def shutdown_weight_transfer_engine(self) -> None:
        """The server's transfer engine leaves the group."""
        request = pb2.ShutdownWeightTransferEngineRequest()
        await self._connection.unary(self._stub.ShutdownWeightTransferEngine, request, None)
