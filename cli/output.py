"""How the client commands print: aligned fields and tables on a terminal, JSON otherwise.

Runs in the `enginectl` process. `Output` picks the mode once (`-o table|json`, else a table
when stdout is a terminal, as kubectl and vLLM's CLI do) and writes one value, one stream
event or one refreshing frame at a time; the rest of this module formats plain values into
text and touches no stream. JSON shapes are the client's dataclasses (`dataclasses.asdict`),
with datetimes as ISO 8601, so a script reads the same fields the Python client returns.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

# Clear the screen and home the cursor: plain ANSI (any terminal, over SSH), no curses.
CLEAR = "\x1b[H\x1b[2J"
NONE = "-"


def to_json(value: object) -> str:
    """One JSON line for a dataclass (or a JSON-able value); datetimes as ISO 8601, ranges as
    lists."""

    def default(obj: object) -> object:
        if isinstance(obj, datetime):
            return obj.isoformat()
        if isinstance(obj, range):  # ServerInfo.managed_ranks: the ranks, listed
            return list(obj)
        return str(obj)

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(value, default=default)


def cell(value: object) -> str:
    """A value as a table cell or field: None is "-", booleans true/false, times in UTC."""
    if value is None or value == "":
        return NONE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def human_bytes(n: int) -> str:
    """Bytes in decimal units (as the progress bar shows them): 210.0 MB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def human_seconds(seconds: float | None) -> str:
    """A duration or an age: 0.42s, 12s, 3m12s, 2h05m; "-" when unknown."""
    if seconds is None:
        return NONE
    if seconds < 10:
        return f"{seconds:.2f}s" if seconds < 1 else f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def when(time: datetime | None, now: datetime | None = None) -> str:
    """A point in time with its age: 2025-01-01 12:00:00 UTC (3m12s ago)."""
    if time is None:
        return NONE
    age = ((now or datetime.now(timezone.utc)) - time).total_seconds()
    return f"{cell(time)} ({human_seconds(max(age, 0.0))} ago)"


def fields(pairs: Sequence[tuple[str, object]]) -> str:
    """Aligned `Key:  value` lines (kubectl describe); a list value takes one line per item."""
    width = max(len(key) for key, _ in pairs) + 3  # the colon, then at least two spaces
    lines = []
    for key, value in pairs:
        items = [cell(v) for v in value] if isinstance(value, (list, tuple)) else [cell(value)]
        items = items or [NONE]
        lines.append(f"{key + ':':<{width}}{items[0]}")
        lines.extend(" " * width + item for item in items[1:])
    return "\n".join(lines)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell, three spaces apart (kubectl get)."""
    cells = [[cell(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    return "\n".join(
        "   ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [list(headers), *cells]
    )


@dataclasses.dataclass(frozen=True)
class Columns:
    """Fixed-width columns for a stream: the header is printed once, then a row per event."""

    headers: tuple[tuple[str, int], ...]

    def header(self) -> str:
        return self.row([name for name, _ in self.headers])

    def row(self, values: Sequence[object]) -> str:
        parts = [cell(v).ljust(width) for v, (_, width) in zip(values, self.headers, strict=True)]
        return "   ".join(parts).rstrip()


class Output:
    """Where and how a command prints. `mode` is "json", "table" or None (decide by the
    terminal: a table when `stream` is a terminal, JSON otherwise)."""

    def __init__(self, mode: str | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.json = mode == "json" if mode else not self.tty
        self._header_done = False
        self._frames = 0

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def show(self, value: object, render: Callable[[Any], str]) -> None:
        """One result: a JSON line, or `render(value)`."""
        self._write(to_json(value) if self.json else render(value))

    def event(self, value: object, columns: Columns, row: Callable[[Any], Sequence[object]]) -> None:
        """One event of a stream: a JSON line, or a row under a header printed once."""
        if self.json:
            self._write(to_json(value))
            return
        if not self._header_done:
            self._write(columns.header())
            self._header_done = True
        self._write(columns.row(row(value)))

    def frame(self, value: object, render: Callable[[Any], str]) -> None:
        """One refresh of a live view: redrawn in place on a terminal; else printed after the
        previous one (a blank line between), or one JSON line."""
        if self.json:
            self._write(to_json(value))
        elif self.tty:
            self._write(CLEAR + render(value))
        else:
            self._write(("\n" if self._frames else "") + render(value))
        self._frames += 1
