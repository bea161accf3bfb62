"""WeightSyncClient: vLLM's four-step weight-sync client, over enginectl's gRPC.

Runs in the trainer process. It has the methods of vLLM's `VLLMWeightSyncClient` protocol
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`, and `shutdown_weight_transfer_engine`), so any trainer-side engine of
vLLM's `WeightTransferTrainerFactory` drives an `enginectl serve` through it, and each round
is an enginectl update: a version recorded only on success, fencing, a request id, the pause
mode, deadlines, the partial rule (docs/weights.md, "vLLM's weight-transfer engines"). Its
methods are blocking and thread-safe (a trainer engine runs `update_weights` on a thread
beside its broadcast); errors are EnginectlErrors carrying the server's reason.

It is the blocking twin of the trainer client's transfer steps (trainer_transfer.py
`TransferRounds`, forwarded by AsyncTrainerClient), run on a private event-loop thread like
every blocking client (_sync.py), with the round options of its constructor bound to each
round.
"""

from __future__ import annotations

from enginectl.client._sync import LoopOwner, blocking
from enginectl.client.trainer import AsyncTrainerClient
from enginectl.client.trainer_requests import GRACE_S, PAUSE_MODES
from enginectl.client.trainer_transfer import RoundOptions
from enginectl.client.trainer_types import UpdateResult

__all__ = ["GRACE_S", "WeightSyncClient"]  # GRACE_S: past a round's own timeout, for the finish's answer


class WeightSyncClient(LoopOwner[AsyncTrainerClient]):
    """One server's four steps. Per round: `pause_mode`, `timeout` (the whole round) and
    `step_timeout` (the longest wait for the trainer's next step); `etag` fences the round's
    start and finish (`finish_weight_update(version, etag=...)` overrides it). With
    `stage_only` a round stages instead (docs/weights.md, "Two-phase updates"): nothing is
    paused or applied, and `last_result.staged` names the set `commit_staged_weights` applies.
    After a round, `last_result` is its UpdateResult."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        pause_mode: str = "keep",
        timeout: float | None = None,
        step_timeout: float | None = None,
        etag: str | None = None,
        request_id: str | None = None,
        stage_only: bool = False,
        rpc_timeout: float = 120.0,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {sorted(PAUSE_MODES)}, not {pause_mode!r}")
        self.pause_mode, self.timeout, self.step_timeout = pause_mode, timeout, step_timeout
        self.etag, self.request_id, self.stage_only = etag, request_id, stage_only
        self.operation = ""  # the open round's Operation
        self.last_result: UpdateResult | None = None

        async def connect() -> AsyncTrainerClient:
            return AsyncTrainerClient(target, token=token, timeout=rpc_timeout)

        super().__init__("enginectl-WeightSyncClient", connect)

    init_weight_transfer_engine = blocking(AsyncTrainerClient.init_weight_transfer_engine)
    update_weights = blocking(AsyncTrainerClient.update_weights)
    shutdown_weight_transfer_engine = blocking(AsyncTrainerClient.shutdown_weight_transfer_engine)

    def start_weight_update(self) -> None:
        """Start a round with this client's options; its Operation is `operation`."""
        options = RoundOptions(
            pause_mode=self.pause_mode,
            timeout=self.timeout,
            step_timeout=self.step_timeout,
            etag=self.etag,
            request_id=self.request_id,
            stage_only=self.stage_only,
        )
        self.operation = self._loop.run(self._core.start_weight_update(options)).name

    def finish_weight_update(self, weight_version: str | None = None, *, etag: str | None = None) -> None:
        """End the round and declare `weight_version` on success, fenced by `etag` (default:
        this client's); its UpdateResult becomes `last_result`, or its error is raised."""
        fence = etag if etag is not None else self.etag or ""
        self.last_result = self._loop.run(self._core.finish_weight_update(weight_version, etag=fence))
