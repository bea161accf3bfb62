"""ZMQ frames of forward-pass metrics, encoded and decoded in this one place.

Torch-free: imported by every EngineCore's publisher (worker/fpm/publisher.py) and by the
relay in the `enginectl serve` process (server/fpm/relay.py, server/fpm/relay_zmq.py).

The relay binds a SUB socket on a private ipc:// endpoint (EngineConfig.fpm_endpoint in
contract/engine.py) and subscribes to everything (SUBSCRIBE_ALL); each rank's publisher
connects an XPUB socket to it and waits, bounded, for that subscription before its first send.
Every message is one frame: the start's key (contract/engine_config.py `frame_key`) followed by
a serialized ForwardPassMetrics (protos/enginectl/fpm/v1/forward_pass_metrics.proto) with
`schema_version` SCHEMA_VERSION and `sequence` and `weight_revision` unset; the relay stamps
those two, and drops and counts a frame without the key (docs/multinode.md). The relay writes the
key beside its ipc:// socket (KEY_FILE, in its private directory), where a publisher of its own
host that is no EngineCore (a benchmark's, a test's) reads it: `local_relay_key`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from google.protobuf.message import DecodeError

from enginectl.fpm.v1.forward_pass_metrics_pb2 import ForwardPassMetrics

SCHEMA_VERSION: Final = 1
SUBSCRIBE_ALL: Final = b""  # the relay's subscription: every frame, no topic prefix
KEY_FILE: Final = "key"  # beside the relay's ipc:// socket: the start's frame key


def key_file(ipc_endpoint: str) -> Path:
    """Where the relay bound at `ipc_endpoint` keeps the start's frame key."""
    return Path(ipc_endpoint.removeprefix("ipc://")).parent / KEY_FILE


def local_relay_key(ipc_endpoint: str) -> bytes:
    """The frame key of the relay bound at `ipc_endpoint`, for a publisher on its host: what it
    wrote to `key_file` (readable by the relay's user only); b"" if it wrote none."""
    try:
        return key_file(ipc_endpoint).read_bytes()
    except FileNotFoundError:
        return b""


def sample_frame(sample: ForwardPassMetrics) -> bytes:
    """The frame a publisher sends for `sample`."""
    return sample.SerializeToString()


# How the relay reads a frame, a few hundred thousand times a second under overload, so as
# names to use inline rather than a function to call: `parse_frame(frame)` is the sample, and
# the frame is malformed when that raises FrameError or the sample's schema_version is 0
# (server/fpm/relay.py drops and counts it).
parse_frame: Final = ForwardPassMetrics.FromString
FrameError: Final = DecodeError
