"""The progress bar the trainer client draws while a weight update runs.

Runs wherever the client runs; imports neither torch nor vLLM (tqdm only when installed).
"""

from __future__ import annotations

import sys
from typing import IO, Any

from enginectl.client.trainer_types import UpdateProgress


class ProgressBar:
    """Draws an update's progress (bytes done of total, phase) on `stream` (stderr): tqdm
    when it is installed, else a plain text bar."""

    WIDTH = 30

    def __init__(self, stream: IO[str] | None = None, *, use_tqdm: bool = True) -> None:
        self.stream = stream or sys.stderr
        self._tqdm: Any = None
        self._last = ""
        self._tqdm_mod: Any = None
        if use_tqdm:
            try:
                import tqdm

                self._tqdm_mod = tqdm
            except ImportError:
                pass

    def update(self, progress: UpdateProgress) -> None:
        total = max(progress.bytes_total, 1)
        if self._tqdm_mod is not None:
            if self._tqdm is None:
                self._tqdm = self._tqdm_mod.tqdm(
                    total=total, unit="B", unit_scale=True, file=self.stream, desc="weights"
                )
            self._tqdm.set_postfix_str(f"{progress.phase} {progress.tensors_done}/{progress.tensors_total} tensors")
            self._tqdm.update(progress.bytes_done - self._tqdm.n)
            return
        filled = int(self.WIDTH * min(progress.bytes_done, total) / total)
        line = (
            f"\rweights [{'#' * filled}{'.' * (self.WIDTH - filled)}] {100 * progress.bytes_done / total:5.1f}% "
            f"{progress.tensors_done}/{progress.tensors_total} tensors "
            f"{progress.bytes_done / 1e6:.1f}/{progress.bytes_total / 1e6:.1f} MB {progress.phase:<14}"
        )
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._last:
            self.stream.write("\n")
            self.stream.flush()


class FleetProgress:
    """One line for a fleet step on many servers (`staging  h1:50051 45%  h2:50051 DONE`),
    redrawn in place on `stream` (stderr)."""

    def __init__(self, what: str, stream: IO[str] | None = None) -> None:
        self.what = what
        self.stream = stream or sys.stderr
        self._last = ""

    def update(self, progress: dict[str, UpdateProgress]) -> None:
        parts = []
        for target, p in progress.items():
            done = 100 * p.bytes_done / p.bytes_total if p.bytes_total else 0.0
            parts.append(f"{target} {p.phase if p.phase in ('STAGED', 'DONE', 'FAILED') else f'{done:5.1f}%'}")
        line = f"\r{self.what}  " + "  ".join(parts)
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self._last:
            self.stream.write("\n")
            self.stream.flush()
