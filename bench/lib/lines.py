"""The worker side of the JSON-lines protocol between `python -m bench` and its subprocesses:
one JSON object a line on stdout, with an `event`; an `error` line reports a failure (bench/lib/procs.py's
`Worker.expect` raises it in the orchestrator)."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def report_errors(command: Callable[[], object]) -> int:
    """Run a worker's command; an exception becomes an `error` line and exit code 1."""
    try:
        command()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        emit("error", message=repr(exc), traceback=traceback.format_exc()[-2000:])
        return 1
    return 0
