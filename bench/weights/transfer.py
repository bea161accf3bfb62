"""The transfer-engine rows of the weights phase (docs/weights.md, "vLLM's weight-transfer engines").

Runs in the weights phase's client process (bench/weights/clients.py `run`), against the
phase's `enginectl serve`, which runs with `--weight-transfer-config '{"backend": "gloo"}'`
and vLLM's /collective_rpc kept (--allow-vllm-dev-routes). One trainer on vLLM's trainer-side
API (`WeightTransferTrainerFactory`, enginectl's registered `gloo` engine) sends the same
checkpoint two ways, round by round over one group on the same engine:

- **vllm_native**: vLLM's own four steps with no enginectl in the way: the worker methods
  (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
  `finish_weight_update`) through vLLM's `collective_rpc`, as `AsyncLLM`'s methods call them;
- **enginectl**: the same engine driven as an enginectl round over gRPC
  (`enginectl.client.transfer_client.WeightSyncClient`): pause, the steps, the cache reset,
  the version recorded with its fingerprint, resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class CollectiveRpcClient:
    """vLLM's four steps on the engine's workers through vLLM's /collective_rpc (AsyncLLM's own
    start_weight_update & co. are that call)."""

    def __init__(self, post: Callable[[str, dict[str, Any]], Any]) -> None:
        self._post = post

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self._post("/collective_rpc", {"method": method, "kwargs": kwargs, "timeout": 600})

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self._rpc("shutdown_weight_transfer_engine")


def measure_transfer(
    target: str, post: Callable[[str, dict[str, Any]], Any], named: list[tuple[str, Any]], workers: int, reps: int
) -> dict[str, Any]:
    """Wall times of `reps` full rounds each way (`post`: a JSON POST to the server's HTTP API),
    interleaved round by round over ONE group: the trainer engine's client is swapped between
    rounds (both reach the same workers' engine), in ABBA order so drift cancels. One untimed
    round each way first (a new group's receive buffers fill fresh pages once). Between rounds,
    untimed, a full VerifyWeights waits out the full fingerprint an enginectl declaration
    takes in the background (docs/weights.md, "Threads and the weights"): its slices would
    otherwise queue ahead of the next round's steps, whichever way that round goes."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from enginectl.client import TrainerClient
    from enginectl.client.transfer_client import WeightSyncClient
    from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register

    register()
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0, timeout_s=300)
    sync = WeightSyncClient(target, rpc_timeout=600)
    settle = TrainerClient(target, timeout=600)
    clients: dict[str, Any] = {"vllm_native": CollectiveRpcClient(post), "enginectl": sync}
    times: dict[str, list[float]] = {way: [] for way in clients}
    engine = WeightTransferTrainerFactory.trainer_init(info, client=sync, source=StateDictSource(named))

    def round_(way: str, i: int) -> float:
        settle.verify_weights(full=True)
        engine.client = clients[way]
        t0 = time.perf_counter()
        if way == "enginectl":
            engine.send_weights(weight_version=f"transfer-{i}")
        else:
            engine.send_weights()
        return time.perf_counter() - t0

    try:
        for way in clients:
            round_(way, -1)
        for i in range(reps):
            order = ("vllm_native", "enginectl") if i % 2 == 0 else ("enginectl", "vllm_native")
            for way in order:
                times[way].append(round_(way, i))
    finally:
        engine.shutdown()
        sync.shutdown_weight_transfer_engine()
        sync.close()
        settle.close()
    return times


def transfer_rows(ck: dict[str, Any]) -> list[tuple[str, str, float, float]]:
    """(figure, baseline, enginectl ms, baseline ms) of one checkpoint's transfer rows."""
    tr = ck.get("transfer")
    if not tr:
        return []
    ours = tr["enginectl"]["median_ms"]
    rows = [
        (
            "vLLM transfer engine `gloo`, as an enginectl round",
            "vLLM's native four steps, same engine",
            ours,
            tr["vllm_native"]["median_ms"],
        )
    ]
    gloo = ck.get("gloo", {}).get("enginectl")
    if gloo:
        rows.append(
            (
                "vLLM transfer engine `gloo`, as an enginectl round",
                "UpdateWeightsFromDistributed (gloo)",
                ours,
                gloo["median_ms"],
            )
        )
    return rows
