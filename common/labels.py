"""The label rule: what a weight version or a worker id may be.

Pure Python, no torch, no vLLM: imported by the `enginectl serve` process (server/limits.py,
the bounds table) and inside every EngineCore (worker/fpm/identity.py), so both sides apply
one rule. The worker never imports the server.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Final

# A worker id: 1..256 bytes of UTF-8 without control characters.
MAX_WORKER_ID_BYTES: Final = 256


class LabelProblem(Enum):
    """Why a string can not be a label (a version or a worker id)."""

    EMPTY = "empty"
    TOO_LONG = "too long"
    CONTROL_CHARACTER = "control character"


# Unicode category Cc: C0 (NUL, LF, ESC, ...), DEL and C1. Labels go into log lines, metric
# label values and gRPC metadata, where these split lines, forge records or are refused.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def label_problem(value: str, max_bytes: int) -> LabelProblem | None:
    """None when `value` is 1..`max_bytes` bytes of UTF-8 without control characters; else
    what is wrong with it. The one rule for versions and worker ids; callers map the
    problem to their own stable reason."""
    if not value:
        return LabelProblem.EMPTY
    if len(value) > max_bytes or len(value.encode("utf-8")) > max_bytes:
        return LabelProblem.TOO_LONG
    if _CONTROL.search(value):
        return LabelProblem.CONTROL_CHARACTER
    return None
