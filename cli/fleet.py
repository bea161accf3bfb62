"""`enginectl fleet status|update|verify|repair --targets A,B,...`: a fleet of servers from a terminal
or a script (enginectl.client.Fleet; docs/cli.md, "Fleet").

Runs in the `enginectl` process. A table on a terminal, one JSON document with `-o json` (or
when stdout is not a terminal). Every server's outcome is printed, including the failed ones,
and the exit code says whether the whole fleet did what was asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from enginectl.cli.exit_codes import ExitCode
from enginectl.cli.output import Output, human_seconds, table
from enginectl.client.client import ChannelOptions
from enginectl.client.errors import EnginectlError
from enginectl.client.fleet import MODES, Fleet
from enginectl.client.fleet_types import (
    FleetCommit,
    FleetError,
    FleetStageError,
    FleetStatus,
    ServerOutcome,
    ServerStatus,
)
from enginectl.client.trainer_types import Verification


def add_commands(sub: Any, group: Any, leaf: Any) -> None:
    """The `fleet` command and its verbs (args.py passes its own helpers)."""
    verbs = group(sub, "fleet", "many servers, one version: status, two-phase update, verify, repair")
    status = leaf(verbs, "status", "every server's version, health, generation state and staged set", "--targets A,B")
    update = leaf(
        verbs,
        "update",
        "stage PATH on every server while they generate, then commit everywhere (two-phase)",
        "PATH --version V --targets A,B [--mode strict|loose] [--no-fence]",
    )
    update.add_argument("path", metavar="PATH", help="safetensors on the servers (the same path on each)")
    update.add_argument("--version", required=True, help="the version every server declares")
    update.add_argument(
        "--mode",
        choices=MODES,
        default="strict",
        help="strict: one global pause around every commit; loose: each server on its own",
    )
    update.add_argument(
        "--no-fence", action="store_true", help="commit even if a server's version changed since staging"
    )
    verify = leaf(verbs, "verify", "VerifyWeights on every server", "--targets A,B [--full]")
    verify.add_argument("--full", action="store_true", help="hash every byte (default: sample every tensor)")
    repair = leaf(
        verbs,
        "repair",
        "bring quarantined, held or paused servers to the fleet's version, from what the servers hold",
        "--targets A,B [--version V]",
    )
    repair.add_argument("--version", help="the version to repair to (default: the one the servers name)")
    for parser in (status, update, verify, repair):
        parser.add_argument("--targets", metavar="A,B,...", help="the servers (default: --target)")


def comma_list(value: str | None) -> list[str]:
    """The items of a comma-separated flag (`--targets A,B`), blanks dropped."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def targets(args: argparse.Namespace) -> list[str]:
    """The servers `--targets` names (default: `--target`)."""
    return comma_list(args.targets or args.target)


def status(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    with Fleet(targets(args), **options) as fleet:
        state = fleet.status()
    document = dataclasses.asdict(state) | {"consistent": state.consistent}
    for target, server in state.servers.items():
        document["servers"][target]["quarantined"] = server.quarantined
    out.show(document, lambda _: _status_view(state))
    unreachable = any(s.error is not None for s in state.servers.values())
    return ExitCode.UNAVAILABLE if unreachable else ExitCode.OK


def update(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    with Fleet(targets(args), **options) as fleet:
        try:
            commit = fleet.update_from_disk(
                args.path, args.version, mode=args.mode, fence=not args.no_fence, progress=sys.stderr.isatty()
            )
        except FleetError as err:
            print(f"enginectl: {err.args[0]}", file=sys.stderr)
            step, outcomes = "stage" if isinstance(err, FleetStageError) else "commit", err.outcomes
            out.show(_outcomes_document(step, args.version, outcomes), lambda _: _outcomes_view(outcomes))
            return ExitCode.ERROR
    out.show(_commit_document(commit), lambda _: _outcomes_view(commit.outcomes))
    return ExitCode.OK


def repair(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    """Fleet.repair from a fresh process: what to do is read from the servers."""
    with Fleet(targets(args), **options) as fleet:
        try:
            done = fleet.repair(args.version)
        except FleetError as err:
            print(f"enginectl: {err.args[0]}", file=sys.stderr)
            outcomes = err.outcomes
            out.show(_outcomes_document("repair", args.version, outcomes), lambda _: _outcomes_view(outcomes))
            return ExitCode.ERROR
    out.show(_commit_document(done), lambda _: _outcomes_view(done.outcomes) if done.outcomes else "nothing to repair")
    return ExitCode.OK


def verify(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    with Fleet(targets(args), **options) as fleet:
        verdicts = fleet.verify(full=args.full)
    document = {
        t: (dataclasses.asdict(v) if isinstance(v, Verification) else {"error": str(v)}) for t, v in verdicts.items()
    }
    out.show(document, lambda _: _verify_view(verdicts))
    ok = all(isinstance(v, Verification) and v.verdict == "MATCH" for v in verdicts.values())
    return ExitCode.OK if ok else ExitCode.ERROR


# --- views ---------------------------------------------------------------------------------


def _status_view(state: FleetStatus) -> str:
    rows: list[tuple[object, ...]] = []
    for target, s in state.servers.items():
        if s.error is not None:
            rows.append((target, "UNREACHABLE", "-", "-", "-", "-", str(s.error)[:60]))
            continue
        version = s.version.version if s.version and s.version.declared else "<undeclared>"
        generation = "-"
        if s.generation is not None:
            generation = f"paused ({s.generation.reason})" if s.generation.paused else "running"
        staged = s.staged.name.removeprefix("staged/")[:12] if s.staged else "-"
        ages = " ".join(f"r{r.dp_rank}:{human_seconds(r.age_s)}" for r in s.ranks) or "-"
        revision = s.version.revision if s.version else "-"
        health = "QUARANTINED" if s.quarantined else "SERVING" if s.serving else "NOT_SERVING"
        rows.append((target, health, version, revision, generation, staged, ages))
    notes = [_server_notes(t, s) for t, s in state.servers.items()]
    verdict = "consistent" if state.consistent else f"NOT consistent (versions: {sorted(map(str, state.versions))})"
    return (
        table(("TARGET", "HEALTH", "VERSION", "REV", "GENERATION", "STAGED", "FPM AGE"), rows)
        + "".join(n for n in notes if n)
        + f"\n\nfleet: {verdict}"
    )


def _server_notes(target: str, s: ServerStatus) -> str:
    """A server's last failure and who staged its set, when there is one."""
    lines = []
    if s.last_failure is not None:
        f = s.last_failure
        lines.append(
            f"  last failure: {f.cause or f.reason} in {f.operation or '-'} (attempted {f.attempted_version!r})"
        )
    staged = s.staged
    if staged is not None:
        when = f"staged {staged.stage_time.isoformat(timespec='seconds')}" if staged.stage_time else "still staging"
        by = f" by {staged.staged_by}" if staged.staged_by else ""
        lines.append(f"  staged set: {staged.name} (version {staged.weight_version!r}), {when}{by}")
    return f"\n\n{target}:\n" + "\n".join(lines) if lines else ""


def _outcomes_view(outcomes: dict[str, ServerOutcome]) -> str:
    rows = []
    for target, o in outcomes.items():
        result = "ok" if o.ok else (o.state or "failed")
        version = o.result.weight_version.version if o.result and o.result.weight_version.version else "-"
        paused = human_seconds(o.result.duration) if o.result else "-"
        rows.append((target, result, version, paused, f"{o.error.reason}: {o.error.message}"[:80] if o.error else ""))
    return table(("TARGET", "RESULT", "VERSION", "DURATION", "ERROR"), rows)


def _verify_view(verdicts: dict[str, Verification | EnginectlError]) -> str:
    rows = [
        (t, v.verdict, v.method, "") if isinstance(v, Verification) else (t, "ERROR", "-", str(v)[:80])
        for t, v in verdicts.items()
    ]
    return table(("TARGET", "VERDICT", "METHOD", "ERROR"), rows)


def _commit_document(commit: FleetCommit) -> dict[str, Any]:
    return _outcomes_document("commit", commit.version, commit.outcomes) | {"mode": commit.mode, "ok": commit.ok}


def _outcomes_document(step: str, version: str | None, outcomes: dict[str, ServerOutcome]) -> dict[str, Any]:
    return {
        "step": step,
        "version": version,
        "servers": {
            t: {
                "ok": o.ok,
                "state": o.state,
                "error": {"code": o.error.code.name, "reason": o.error.reason, "message": o.error.message}
                if o.error
                else None,
                "weight_version": dataclasses.asdict(o.result.weight_version) if o.result else None,
            }
            for t, o in outcomes.items()
        },
    }
