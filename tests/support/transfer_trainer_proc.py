"""A trainer on vLLM's trainer-side API with enginectl's `gloo` engine, as a separate process.

Runs as `python tests/support/transfer_trainer_proc.py HTTP_URL FILE MODE [VERSION]`, through vLLM's
`HTTPVLLMWeightSyncClient` and its four routes: builds the engine with vLLM's
`WeightTransferTrainerFactory` (world size: the trainer and one worker), then
- MODE `full`: as vLLM's examples write a trainer, init (by `trainer_init`) then one round of
  every tensor of FILE, declaring VERSION when given; prints {"sent": n}, shuts the transfer
  down on both sides, exits 0;
- MODE `die`: starts a round (printing its Operation's name with the count), has the workers receive it (`update_weights`, on a thread),
  broadcasts half the tensors (one broadcast each), prints {"sent": n}, and exits at once with os._exit (a
  trainer killed between start and finish, after bytes went out).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import requests
from safetensors.torch import load_file
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from enginectl.client.transfer_engine import GlooTrainerInitInfo, StateDictSource, register
from enginectl.common.buckets import cut


def main() -> None:
    url, file, mode = sys.argv[1:4]
    version = sys.argv[4] if len(sys.argv) > 4 else None
    register()
    client = HTTPVLLMWeightSyncClient(url, timeout=60)
    tensors = load_file(file)
    source = StateDictSource(tensors)
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=0, world_size=2, rank=0, timeout_s=30.0, bucket_bytes=0
        ),
        client=client,
        source=source,
    )
    if mode == "full":
        engine.send_weights(weight_version=version)
        print(json.dumps({"sent": len(tensors)}), flush=True)
        engine.shutdown()
        client.shutdown_weight_transfer_engine()
        return
    values = list(tensors.values())
    started = requests.post(f"{url}/start_weight_update", json={}, timeout=60)
    started.raise_for_status()
    threading.Thread(target=client.update_weights, args=(engine.update_info(),), daemon=True).start()
    half = cut([t.numel() * t.element_size() for t in values], 0)[: len(values) // 2]
    sent = engine.group.broadcast(values, half)
    print(json.dumps({"sent": sent, "operation": started.json()["operation"]}), flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
