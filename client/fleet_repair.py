"""What a fleet's repair does, read from the servers alone (docs/weights.md, "The fleet").

Runs in the trainer process; plain functions over a FleetStatus (fleet_types.py), no I/O. A
trainer that restarted knows nothing of its predecessor's commit, so Fleet.repair asks the
servers instead: each one's version, quarantine (its WeightVersion's `last_failure`), pause and
staged set say what is left to do.

- The version to repair to is the one the caller names, else the one this process's last
  failed commit declared, else the one the servers agree on: every quarantined server's failed
  update attempted it, or a server holds it staged without serving it; failing both, every
  healthy server serves it. Servers that name two versions are refused (pass one).
- Per server: nothing when it serves that version, running, not quarantined; a resume when it
  serves it but is held paused (a fleet's barrier pause its trainer never lifted); a commit of
  its staged set (then the resume) when it holds one for that version (or for none); else it
  can not be repaired from what it holds, and the reason says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginectl.client.fleet_types import FleetStatus, ServerStatus


class RepairUnclear(ValueError):
    """The servers do not say which version the fleet was moving to."""


@dataclass(frozen=True)
class Repair:
    """What repair does on one server: `action` "commit" (its staged set `staged`, then a
    resume), "resume", or "" (it can not be repaired from what it holds: `why`)."""

    target: str
    action: str
    staged: str = ""
    why: str = ""


def serves(server: ServerStatus, version: str) -> bool:
    """`version` declared, generation running, no quarantine."""
    return (
        server.version is not None
        and server.version.declared
        and server.version.version == version
        and server.generation is not None
        and not server.generation.paused
        and not server.quarantined
    )


def repair_version(status: FleetStatus) -> str:
    """The version the servers say the fleet was moving to (module docstring)."""
    named: set[str] = set()
    for server in status.servers.values():
        failure = server.last_failure
        if server.quarantined and failure is not None and failure.attempted_version:
            named.add(failure.attempted_version)
        staged = server.staged
        if staged is not None and staged.weight_version is not None:
            current = server.version.version if server.version is not None else None
            if current != staged.weight_version or server.quarantined:
                named.add(staged.weight_version)
    if not named:
        named = {
            s.version.version
            for s in status.servers.values()
            if s.version is not None and s.version.version is not None and serves(s, s.version.version)
        }
    if len(named) != 1:
        found = ", ".join(sorted(named)) or "none"
        raise RepairUnclear(f"the servers do not name one version to repair to (they name: {found}); pass version=")
    return named.pop()


def repairs(status: FleetStatus, version: str) -> dict[str, Repair]:
    """What to do on each server that does not serve `version` (module docstring)."""
    plan: dict[str, Repair] = {}
    for target, server in status.servers.items():
        if server.error is not None or server.version is None:
            plan[target] = Repair(target, "", why=f"could not be read: {server.error}")
        elif serves(server, version):
            continue
        elif server.version.version == version and server.version.declared and not server.quarantined:
            plan[target] = Repair(target, "resume")
        elif server.staged is None:
            plan[target] = Repair(
                target, "", why=f"nothing staged to commit: update it to {version!r} (stage and commit, or one update)"
            )
        elif server.staged.weight_version not in (None, version):
            plan[target] = Repair(
                target,
                "",
                why=f"its staged set {server.staged.name} holds version {server.staged.weight_version!r}, "
                f"not {version!r}: discard it and update the server",
            )
        else:
            plan[target] = Repair(target, "commit", staged=server.staged.name)
    return plan
