"""A CPU burner for tests: one busy Python process beside the servers, so that threads of the
trainer and of the engine wait for a core, as under load.

Runs in the pytest process; the burner is its child (`python -c "while True: pass"`), pinned
to nothing in particular, and only that child is ever stopped.

    with cpu_burner():
        ...  # every core the scheduler gives the burner is one the test competes for
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

STOP_TIMEOUT_S = 10.0


@contextlib.contextmanager
def cpu_burner() -> Iterator[subprocess.Popen[bytes]]:
    """One busy process for the block; killed (by its own pid) and reaped after it."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)
