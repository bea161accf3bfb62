"""The transfer-engine rows of the weights phase (docs/weights.md, "vLLM's weight-transfer engines").

Runs in the weights phase's client process (bench/weights/clients.py `run`), against the
phase's `enginectl serve`, which runs with `--weight-transfer-config '{"backend": "gloo"}'`
and vLLM's /collective_rpc kept (--allow-vllm-dev-routes). One trainer on vLLM's trainer-side
API (`WeightTransferTrainerFactory`, enginectl's registered `gloo` engine) sends the same
checkpoint two ways, in alternating blocks on the same engine:

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

BLOCKS = 2  # alternating blocks of each way (a switch re-initialises the engine)


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
    """Median wall times of a full round each way (`post`: a JSON POST to the server's HTTP API)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from enginectl.client.transfer_client import WeightSyncClient
    from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register

    register()
    source = StateDictSource(named)
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0, timeout_s=300)
    times: dict[str, list[float]] = {"vllm_native": [], "enginectl": []}
    per_block = max(1, reps // BLOCKS)
    for block in range(BLOCKS):
        for way in ("vllm_native", "enginectl"):
            client: Any = (
                CollectiveRpcClient(post) if way == "vllm_native" else WeightSyncClient(target, rpc_timeout=600)
            )
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
            try:
                engine.send_weights()  # untimed: a new group's receive buffers fill fresh pages once
                for i in range(per_block):
                    t0 = time.perf_counter()
                    if way == "enginectl":
                        engine.send_weights(weight_version=f"transfer-{block}-{i}")
                    else:
                        engine.send_weights()
                    times[way].append(time.perf_counter() - t0)
            finally:
                engine.shutdown()
                client.shutdown_weight_transfer_engine()
                if way == "enginectl":
                    client.close()
    return {way: t for way, t in times.items()}


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
