"""The per-start engine configuration: what `enginectl serve` hands every EngineCore at start
(the FPM relay's endpoint, the worker id, the heartbeat, the incarnation), and how it travels.

Torch-free and gRPC-free, like contract/engine.py beside it: written by the `enginectl serve`
process (server/wiring.py, server/flags.py) before the EngineCores start, read inside each
EngineCore (worker/fpm/scheduler.py). Its own module because its state is the server's start,
not an update's or a call's.
"""

from __future__ import annotations

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
