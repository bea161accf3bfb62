"""The per-start engine configuration: what `enginectl serve` hands every EngineCore at start
(the FPM relay's endpoints, the worker id, the heartbeat, the incarnation, the channel secret),
and how it travels.

Torch-free and gRPC-free, like contract/engine.py beside it: written by the `enginectl serve`
process (server/wiring.py, server/flags.py) before the EngineCores start, read inside each
EngineCore (worker/fpm/scheduler.py). Its own module because its state is the server's start,
not an update's or a call's.

It travels two ways (DESIGN §13, docs/multinode.md): in an environment variable that the head's
own EngineCores inherit (the cold start), and, for every rank, by the engine's own channel: the
CONFIGURE utility the head calls once the ranks answered the census (worker/fpm/engine_core.py
`configure`). A rank on another node (`enginectl serve --headless`) knows nothing of this start
until then. Every rank receives the same config and picks its relay endpoint by whether it runs
on the head's host (`fpm_endpoint_for`), so one digest (`digest`) says every rank holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from enginectl.contract.engine import read, wire

# `additional_config[CONFIG_KEY]` is where a user (or `enginectl serve`) puts it; serve moves it
# into the environment variable ENGINE_CONFIG_ENV before the EngineCores start, because vLLM
# hashes `additional_config` into its compile-cache key and these values change every start.
CONFIG_KEY: Final = "enginectl"
ENGINE_CONFIG_ENV: Final = "ENGINECTL_ENGINE_CONFIG"
# "full": finite values computed with the bytes each load wrote (worker/weights/written.py);
# "finite": finite values only.
LOAD_CHECKS: Final = ("full", "finite")


class EngineConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    """What `enginectl serve` hands every EngineCore at start."""

    fpm_endpoint: str = ""  # the relay's ZMQ endpoint; "" publishes nothing
    worker_id: str = ""  # the identity every rank starts with (generation 1); "" for none
    await_worker_id: bool = False  # serving waits for SetWorkerIdentity
    heartbeat_interval_s: float = 0.0  # 0: the publisher's default
    incarnation: str = ""  # this start of the server; "" lets the publisher pick one
    # What every worker checks after a load (LOAD_CHECKS; worker/weights/checks.py).
    load_check: str = "full"
    # When the engine's ranks may span hosts (DESIGN §13): the relay's TCP endpoint, which a
    # rank on another host than the head's publishes to instead of `fpm_endpoint` ("": none).
    fpm_tcp_endpoint: str = ""
    head_hostname: str = ""  # the head's host (common/host.py HostIdentity)
    head_boot_id: str = ""
    # The per-start secret (hex) every frame on the relay and on an update's channels begins
    # with, after the incarnation (`frame_key`); frames without it are dropped and counted.
    channel_secret: str = ""
    # How long a rank may be silent before the head takes it for dead, and a headless node's
    # head before the node stops (DESIGN §13 "Liveness").
    liveness_timeout_s: float = 10.0
    # Set by `enginectl serve --headless` for its own EngineCores, never sent: they stop when
    # their head is silent for `liveness_timeout_s` (worker/fpm/publisher.py).
    headless: bool = False

    def frame_key(self) -> bytes:
        """What every frame of this start begins with: b"" when there is no secret."""
        return frame_key(self.incarnation, self.channel_secret)

    def fpm_endpoint_for(self, hostname: str, boot_id: str) -> str:
        """The relay endpoint a rank on host (`hostname`, `boot_id`) publishes to: the TCP
        one when it runs on another host than the head's and there is one."""
        if self.fpm_tcp_endpoint and (hostname, boot_id) != (self.head_hostname, self.head_boot_id):
            return self.fpm_tcp_endpoint
        return self.fpm_endpoint

    def digest(self) -> str:
        """A digest of what the head sent (`headless`, the node's own, left out): equal on
        every rank that holds this start's config."""
        sent = wire(msgspec.structs.replace(self, headless=False))
        return hashlib.sha256(json.dumps(sent, sort_keys=True).encode()).hexdigest()[:16]

    def sent_to(self, held: EngineConfig) -> EngineConfig:
        """This config as a rank that held `held` keeps it: its own `headless` stays."""
        return msgspec.structs.replace(self, headless=held.headless)

    def to_env(self) -> None:
        """Hand this config to EngineCores started from now on (they inherit the environment)."""
        os.environ[ENGINE_CONFIG_ENV] = json.dumps(wire(self))

    @classmethod
    def load(cls, additional_config: Any) -> EngineConfig:
        """Inside an EngineCore: from ENGINE_CONFIG_ENV, else `additional_config[CONFIG_KEY]`."""
        section: Any = None
        if os.environ.get(ENGINE_CONFIG_ENV):
            section = json.loads(os.environ[ENGINE_CONFIG_ENV])
        elif isinstance(additional_config, Mapping):
            section = additional_config.get(CONFIG_KEY)
        return read(cls, {key: value for key, value in dict(section or {}).items() if value is not None})


def frame_key(incarnation: str, secret: str) -> bytes:
    """The prefix of every frame of the start `incarnation` with channel secret `secret`
    (b"" without a secret: nothing is prefixed, nothing checked)."""
    return f"{incarnation}:{secret}:".encode() if secret else b""
