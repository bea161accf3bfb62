"""The scheduler "class" vLLM's EngineCore builds under `enginectl serve` (its `scheduler_cls`).

Runs inside each EngineCore process (one per data-parallel rank), once, when the EngineCore
builds its scheduler, which it does before it answers any utility call. `make_scheduler`
attaches enginectl's EngineCore utilities (worker/attach.py: the weight-update ones and the
identity ones), so they exist in every EngineCore that runs enginectl's scheduler, then builds
that scheduler (worker/fpm/scheduler.py). It lives outside worker/fpm/ because attaching
reaches every room of the worker, fpm's included. Importing this module changes nothing in vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from enginectl.worker.attach import attach
from enginectl.worker.fpm.scheduler import fpm_scheduler


def make_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """Called by the EngineCore in place of a scheduler class: attach enginectl's utilities,
    then the FPM variant of the scheduler vLLM would pick."""
    attach()
    return fpm_scheduler(*args, **kwargs)
