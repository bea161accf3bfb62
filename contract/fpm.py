"""ZMQ frames of forward-pass metrics, encoded and decoded in this one place.

Torch-free: imported by every EngineCore's publisher (worker/fpm/publisher.py) and by the
relay in the `enginectl serve` process (server/fpm/relay.py, server/fpm/relay_zmq.py).

The relay binds a SUB socket on a private ipc:// endpoint (EngineConfig.fpm_endpoint in
contract/engine.py) and subscribes to everything (SUBSCRIBE_ALL); each rank's publisher
connects an XPUB socket to it and waits, bounded, for that subscription before its first send.
Every message is one frame: a serialized ForwardPassMetrics
(protos/enginectl/fpm/v1/forward_pass_metrics.proto) with `schema_version` SCHEMA_VERSION and
`sequence` and `weight_revision` unset; the relay stamps those two.
"""

from __future__ import annotations

from typing import Final

from google.protobuf.message import DecodeError

from enginectl.fpm.v1.forward_pass_metrics_pb2 import ForwardPassMetrics

SCHEMA_VERSION: Final = 1
SUBSCRIBE_ALL: Final = b""  # the relay's subscription: every frame, no topic prefix


class MalformedFrame(ValueError):
    """A frame that is not a ForwardPassMetrics of a known schema."""


def sample_frame(sample: ForwardPassMetrics) -> bytes:
    """The frame a publisher sends for `sample`."""
    return sample.SerializeToString()


def read_sample(frame: bytes) -> ForwardPassMetrics:
    """The sample a frame carries; MalformedFrame when it does not parse or has no schema."""
    try:
        sample = ForwardPassMetrics.FromString(frame)
    except DecodeError as exc:
        raise MalformedFrame(f"not a ForwardPassMetrics: {exc}") from None
    if sample.schema_version == 0:
        raise MalformedFrame("schema_version is unset")
    return sample
