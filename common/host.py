"""Which host, and which boot of it, this process runs on: what a same-host weight update
(UpdateWeightsFromIpc) compares between the trainer and the engine.

Pure Python (no gRPC, no torch): the trainer client sends its identity, the server compares
it with its own. The boot id is the kernel's, so every process of one boot of one machine
shares it, containers included; the host name tells most containers apart. Neither proves
that two processes see the same /dev/shm: a worker that can not open a segment says so
itself (docs/weights.md, "Same-host updates").
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class HostIdentity:
    """The Linux boot id ("" where there is none, e.g. macOS) and the host name."""

    boot_id: str
    hostname: str

    def __str__(self) -> str:
        return f"{self.hostname or '?'} (boot {self.boot_id or 'unknown'})"


def host_identity() -> HostIdentity:
    """This process's host identity, read now."""
    try:
        boot_id = BOOT_ID_PATH.read_text().strip()
    except OSError:
        boot_id = ""
    return HostIdentity(boot_id, socket.gethostname())
