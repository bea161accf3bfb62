"""A trainer that broadcasts through an enginectl update group, as a separate process.

Runs as `python tests/support/group_trainer_proc.py GRPC_TARGET FILE MODE GROUP [VERSION]`,
through enginectl's TrainerClient:
- MODE `die`: creates the group GROUP with the server (this process rank 0, hosting its
  store), prints {"group": GROUP, "world_size": n}, and exits at once with os._exit (a trainer
  killed after InitWeightsUpdateGroup, the engine's workers still members);
- MODE `full`: creates GROUP (a name the server may already hold), broadcasts every tensor of
  FILE as one update declaring VERSION, prints {"version": ..., "ranks": n}, destroys the
  group, exits 0.
"""

from __future__ import annotations

import json
import os
import sys

from safetensors.torch import load_file

from enginectl.client import TrainerClient


def main() -> None:
    target, file, mode, group = sys.argv[1:5]
    version = sys.argv[5] if len(sys.argv) > 5 else None
    with TrainerClient(target, timeout=120.0) as client:
        joined = client.init_weights_update_group(group, timeout=60.0)
        if mode == "die":
            print(json.dumps({"group": joined.group_name, "world_size": joined.world_size}), flush=True)
            os._exit(1)
        result = client.broadcast_weights(load_file(file), version, group_name=group, timeout=120.0)
        print(json.dumps({"version": result.weight_version.version, "ranks": len(result.ranks)}), flush=True)
        client.destroy_weights_update_group(group)


if __name__ == "__main__":
    main()
