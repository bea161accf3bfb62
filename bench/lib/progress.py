"""Progress lines of an orchestrating bench process (`python -m bench`, `python -m bench.soak`),
on stderr: stdout carries the report, and a worker's stdout its JSON lines (bench/lib/lines.py)."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
