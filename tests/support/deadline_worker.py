"""A FAKE worker extension for tests/e2e/test_worker_deadlines.py: enginectl's own, plus a
worker RPC that outlives its timeout on purpose.

Why a fake: every enginectl worker RPC now answers well inside the timeout it is sent with
(docs/architecture.md, "Worker calls and their deadlines"), so no real input makes one late.
The late answer is the fault the EngineCore must still survive (or report), and only a worker
that overstays on purpose can cause it. It runs inside vLLM's worker process
(`--worker-extension-cls support.deadline_worker.LateWorkerExtension`, with tests/ on
PYTHONPATH) and is otherwise enginectl's extension, unchanged.

Starting to join a group whose name begins with `late-<seconds>-` sleeps that many seconds
on the worker's RPC thread first, then behaves as enginectl's own method.
"""

from __future__ import annotations

import time
from typing import Any

from enginectl.contract.engine import read
from enginectl.contract.groups import GroupSpec
from enginectl.worker.weights.extension import EnginectlWorkerExtension

LATE_PREFIX = "late-"


def group_name(seconds: float, tag: str) -> str:
    """A group name whose join start overstays by `seconds` in this extension."""
    return f"{LATE_PREFIX}{seconds:g}-{tag}"


class LateWorkerExtension(EnginectlWorkerExtension):
    def enginectl_init_group(self, spec_wire: Any) -> Any:
        name = read(GroupSpec, spec_wire).name
        if name.startswith(LATE_PREFIX):
            time.sleep(float(name[len(LATE_PREFIX) :].split("-", 1)[0]))  # ok-sleep: the fault, overstaying on purpose
        return super().enginectl_init_group(spec_wire)
