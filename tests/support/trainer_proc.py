"""A trainer as a separate process, for tests: broadcasts a checkpoint through a gloo group.

Runs as `python tests/support/trainer_proc.py TARGET FILE VERSION MODE [TIMEOUT]`, using only
`enginectl.client` (TrainerClient): creates the update group with the server, then
- MODE `full`: broadcasts every tensor of FILE, prints the result as one JSON line, destroys
  the group, exits 0;
- MODE `die`: starts the update, broadcasts half the tensors, prints
  {"operation": name}, and exits at once with os._exit (a trainer killed mid-broadcast);
- MODE `stall`: the same, then blocks reading stdin (a trainer that stops sending) until
  the test closes it.
"""

from __future__ import annotations

import json
import os
import sys

from safetensors.torch import load_file

from enginectl.client import TrainerClient


def main() -> None:
    target, file, version, mode = sys.argv[1:5]
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 120.0
    tensors = load_file(file)
    client = TrainerClient(target)
    group = client.init_weights_update_group("test-trainer", timeout=60.0)
    if mode == "full":
        result = client.broadcast_weights(tensors, version, group_name=group.group_name, timeout=timeout)
        client.destroy_weights_update_group(group.group_name)
        print(
            json.dumps(
                {
                    "operation": result.operation,
                    "ranks": len(result.ranks),
                    "tensors": result.ranks[0].tensors_loaded,
                    "version": result.weight_version.version,
                }
            ),
            flush=True,
        )
        client.close()
        return
    # Small buckets: packed buckets and lone tensors both, and half of them is not all.
    smallest = min(t.numel() * t.element_size() for t in tensors.values())
    broadcast = client.start_broadcast(
        tensors, version, group_name=group.group_name, timeout=timeout, bucket_bytes=4 * smallest
    )
    sent = broadcast.send(len(tensors) // 2)
    assert 0 < sent < len(tensors), f"sent {sent} of {len(tensors)}: not a partial broadcast"
    print(json.dumps({"operation": broadcast.name, "sent": sent}), flush=True)
    if mode == "die":
        os._exit(3)
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    main()
