"""Which host, and which boot of it, this process runs on: what a same-host weight update
(UpdateWeightsFromIpc) compares between the trainer and the engine.

Pure Python (no gRPC, no torch): the trainer client sends its identity, the server compares
it with its own. The boot id is the kernel's, so every process of one boot of one machine
shares it, containers included; the host name tells most containers apart. Neither proves
that two processes see the same /dev/shm: a worker that can not open a segment says so
itself (docs/weights.md, "Same-host updates").
"""

from __future__ import annotations

import hashlib
import ipaddress
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

    @property
    def host_id(self) -> str:
        """An opaque id of this boot of this host (GetServerInfo's RankInfo.host_id): equal for
        two processes exactly when their identities are, without showing the boot id."""
        return hashlib.sha256(f"{self.boot_id}\0{self.hostname}".encode()).hexdigest()[:16]


def host_identity() -> HostIdentity:
    """This process's host identity, read now."""
    try:
        boot_id = BOOT_ID_PATH.read_text().strip()
    except OSError:
        boot_id = ""
    return HostIdentity(boot_id, socket.gethostname())


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP address or a host name) means this host only: 127.0.0.0/8,
    ::1, "localhost", or a name that resolves to loopback addresses only. Resolves names:
    call it off the control loop. A name that does not resolve is not called loopback (the
    join then fails as it would)."""
    host = address.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)
    if host.lower().rstrip(".") == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(resolved) and all(ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in resolved)


def any_port(address: str) -> str:
    """The ZMQ TCP endpoint on a free port of `address` (an IPv6 one in brackets)."""
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"tcp://{host}:0"


def target_host(target: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:a:p")."""
    rest = target
    if "///" in rest:
        rest = rest.split("///", 1)[1]
    elif rest.startswith(("ipv4:", "ipv6:")):
        rest = rest.split(":", 1)[1]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def route_to(target: str) -> str | None:
    """This host's address on the route to `target`'s host (a gRPC target), or None when it
    is a loopback one or can not be found: what a trainer should offer as its broadcast
    master address to that server's ranks. No packet is sent (a UDP socket's connect only
    picks the route). Resolves names: call it off the control loop."""
    host = target_host(target)
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                mine = str(probe.getsockname()[0])
        except OSError:
            continue
        return None if is_loopback(mine) else mine
    return None
