"""The command line of the client commands: every command, flag and help text.

Runs in the `enginectl` process; argparse only. Global flags (target, token, TLS, output,
timeout) are accepted before the command and after it (`enginectl version get -o json`), as
kubectl accepts them. After `identity get|set` and `operation wait`, `--timeout` is theirs:
how long the ranks may take to answer, or how long to wait. docs/cli.md documents all of it.
"""

from __future__ import annotations

import argparse
import os

import enginectl
from enginectl.cli.exit_codes import EPILOG
from enginectl.cli.fleet import add_commands as add_fleet_commands
from enginectl.cli.gateway import add_commands as add_gateway_commands
from enginectl.client.client import DEFAULT_TARGET, DEFAULT_TIMEOUT_S

DESCRIPTION = """Talk to a running `enginectl serve` (a vLLM engine's gRPC control plane).

Output is a table on a terminal and JSON otherwise (one line per result or event);
-o json / --json or -o table choose. `enginectl COMMAND --help` says more."""

EXAMPLES = """examples:
  enginectl version get
  enginectl version set step-42 --etag "$(enginectl version get -o json | jq -r .etag)"
  enginectl weights load /ckpts/step-43 --version step-43
  enginectl identity set worker-a
  enginectl fpm watch --heartbeats --since 1234 --incarnation INC
  enginectl fpm top --targets 10.0.0.1:50051,10.0.0.2:50051"""

PAUSE_MODES = ("keep", "abort", "wait")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks; wider help columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _global_flags(parser: argparse.ArgumentParser, *, suppress: bool, timeout: bool = True) -> None:
    """The flags every command takes. After the command (`suppress`), an absent flag leaves
    the value given before the command (or its default) alone. `timeout=False` for a command
    with a `--timeout` of its own."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global flags")
    if timeout:
        group.add_argument(
            "--timeout",
            type=float,
            default=default(DEFAULT_TIMEOUT_S),
            metavar="S",
            help=f"deadline of each call, seconds (default {DEFAULT_TIMEOUT_S:g})",
        )
    group.add_argument(
        "--target",
        metavar="HOST:PORT",
        default=default(os.environ.get("ENGINECTL_TARGET", DEFAULT_TARGET)),
        help=f"the server's gRPC address ($ENGINECTL_TARGET; default {DEFAULT_TARGET})",
    )
    group.add_argument(
        "--token-file", metavar="FILE", default=default(None), help="bearer token for mutating calls ($ENGINECTL_TOKEN)"
    )
    group.add_argument("--tls", action="store_true", default=default(False), help="TLS with the system's roots")
    group.add_argument("--tls-ca", metavar="FILE", default=default(None), help="TLS, trusting this CA (PEM)")
    group.add_argument("--tls-cert", metavar="FILE", default=default(None), help="client certificate for mTLS (PEM)")
    group.add_argument("--tls-key", metavar="FILE", default=default(None), help="its private key (PEM)")
    group.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default=default(None),
        help="table (default on a terminal) or json (default otherwise)",
    )
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", default=default(None), help="same as -o json"
    )


def _leaf(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help: str,
    usage: str = "",
    *,
    own_timeout: tuple[str, str] | None = None,
) -> argparse.ArgumentParser:
    """A command's verb: its own flags (`usage` sums them up), then the global flags. With
    `own_timeout` (dest, help), `--timeout S` is the verb's own, stored in `dest`."""
    parser = sub.add_parser(
        name,
        help=help,
        description=help,
        usage=f"%(prog)s {usage} [global flags]".replace("  ", " "),
        formatter_class=_Formatter,
        epilog=EPILOG,
    )
    if own_timeout is not None:
        dest, timeout_help = own_timeout
        parser.add_argument("--timeout", dest=dest, type=float, metavar="S", help=timeout_help)
    _global_flags(parser, suppress=True, timeout=own_timeout is None)
    return parser


def _group(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    parser = sub.add_parser(
        name, help=help, description=help, usage="%(prog)s VERB [flags]", formatter_class=_Formatter
    )
    parser.set_defaults(verb=None, help_of=parser)  # no verb: print this help (kubectl does)
    return parser.add_subparsers(dest="verb", metavar="VERB", title="verbs", prog=f"enginectl {name}")


def _version_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "version", "the weight version the engine serves (WeightVersionService)")
    _leaf(verbs, "get", "the declared version, its revision, etag and incarnation")
    set_ = _leaf(
        verbs,
        "set",
        "declare VERSION for the weights in memory (nothing is loaded)",
        "VERSION [--etag E] [--request-id UUID]",
    )
    set_.add_argument("version", metavar="VERSION")
    set_.add_argument("--etag", help="apply only if this is still the current etag (compare-and-set; else exit 5)")
    set_.add_argument("--request-id", metavar="UUID", help="idempotency key (default: a new UUID)")
    watch = _leaf(
        verbs, "watch", "the current state, then every change, until Ctrl-C", "[--since-revision N [--incarnation I]]"
    )
    watch.add_argument("--since-revision", type=int, metavar="N", help="replay every change after revision N first")
    watch.add_argument("--incarnation", help="the incarnation N was read under (refused if the server restarted)")


CHECKPOINT_HELP = "a file, directory or *.safetensors.index.json on the server"
STAGED_HELP = "the staged set (default: the one the server holds)"


def _apply_flags(verb: argparse.ArgumentParser) -> None:
    """The flags of a verb that applies weights (`weights load`, `weights commit`)."""
    verb.add_argument("--etag", help="apply only if this is still the current etag (else exit 5)")
    verb.add_argument("--pause-mode", choices=PAUSE_MODES, default="keep", help="what happens to running requests")
    verb.add_argument("--keep-prefix-cache", action="store_true", help="do not reset the prefix cache")
    verb.add_argument("--update-timeout", type=float, metavar="S", help="seconds the update may take")
    verb.add_argument("--no-wait", action="store_true", help="print the running operation and return")


def _weights_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "weights", "load, stage, commit and verify the engine's weights")
    load = _leaf(
        verbs,
        "load",
        "UpdateWeightsFromDisk: load safetensors at PATH on the server, with a progress bar",
        "PATH [--version V] [--etag E] [--pause-mode M] [--keep-prefix-cache] [--update-timeout S] [--no-wait]",
    )
    load.add_argument("path", metavar="PATH", help=CHECKPOINT_HELP)
    load.add_argument("--version", help="declare this version on success (else: undeclared)")
    _apply_flags(load)
    stage = _leaf(
        verbs,
        "stage",
        "two-phase update, first phase: read safetensors at PATH into the server's staging area while it generates",
        "PATH [--version V] [--update-timeout S]",
    )
    stage.add_argument("path", metavar="PATH", help=CHECKPOINT_HELP)
    stage.add_argument("--version", help="the version the commit declares, unless it names one")
    stage.add_argument("--update-timeout", type=float, metavar="S", help="seconds the stage may take")
    commit = _leaf(
        verbs,
        "commit",
        "two-phase update, second phase: apply the staged set under one short pause",
        "[NAME] [--version V] [--etag E] [--pause-mode M] [--keep-prefix-cache] [--update-timeout S] [--no-wait]",
    )
    commit.add_argument("name", nargs="?", metavar="NAME", help=STAGED_HELP)
    commit.add_argument("--version", help="declare this version (default: the one the stage named)")
    _apply_flags(commit)
    discard = _leaf(verbs, "discard", "drop the staged set (a stage still receiving is cancelled)", "[NAME]")
    discard.add_argument("name", nargs="?", metavar="NAME", help=STAGED_HELP)
    verify = _leaf(
        verbs,
        "verify",
        "VerifyWeights: fingerprint the weights on every rank, compare with the declaration",
        "[--full]",
    )
    verify.add_argument("--full", action="store_true", help="hash every byte (default: sample every tensor)")
    _leaf(verbs, "info", "GetServerInfo: model, parallelism, update backends, limits, where each rank runs")


def _generation_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "generation", "pause and resume generation on every rank")
    _leaf(verbs, "state", "whether generation is paused, why, and the requests per rank")
    pause = _leaf(verbs, "pause", "pause generation on every rank (it stays paused across updates)", "[--mode M]")
    pause.add_argument("--mode", choices=PAUSE_MODES, default="keep", help="keep, abort or drain (wait) requests")
    resume = _leaf(verbs, "resume", "resume generation", "[--force]")
    resume.add_argument("--force", action="store_true", help="resume even over a partial update's mixed weights")


def _operation_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "operation", "weight-update operations (google.longrunning)")
    _leaf(verbs, "get", "an operation as it is now", "NAME").add_argument("name", metavar="NAME")
    listing = _leaf(
        verbs,
        "list",
        "the operations the server keeps, newest first (running, then the last finished)",
        "[--running|--done]",
    )
    only = listing.add_mutually_exclusive_group()
    only.add_argument("--running", dest="done", action="store_false", default=None, help="only running operations")
    only.add_argument("--done", dest="done", action="store_true", help="only finished operations")
    wait = _leaf(
        verbs,
        "wait",
        "wait until the operation is done; exits with its error's code if it failed",
        "NAME [--timeout S]",
        own_timeout=("wait_timeout", "give up after S seconds (exit 6); default: no bound"),
    )
    wait.add_argument("name", metavar="NAME")
    _leaf(verbs, "cancel", "ask the server to stop the update", "NAME").add_argument("name", metavar="NAME")


def _identity_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "identity", "the worker id every rank stamps on its samples (FpmIdentityService)")
    _leaf(
        verbs,
        "get",
        "ask every rank for the identity it holds now",
        "[--timeout S]",
        own_timeout=("rank_timeout", "seconds each rank has to answer (server default 5)"),
    )
    set_ = _leaf(
        verbs,
        "set",
        "set WORKER_ID on every rank (an --await-worker-id server then serves)",
        "WORKER_ID [--timeout S]",
        own_timeout=("rank_timeout", "seconds every rank has to ack (server default 10)"),
    )
    set_.add_argument("worker_id", metavar="WORKER_ID")


def _fpm_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verbs = _group(sub, "fpm", "forward-pass metrics (ForwardPassMetricsService)")
    watch = _leaf(
        verbs,
        "watch",
        "print samples as they are relayed (JSON lines when not a terminal)",
        "[--worker ID]... [--rank N]... [--heartbeats] [--since SEQ [--incarnation I]] [--count N]",
    )
    watch.add_argument("--worker", action="append", default=[], metavar="ID", help="only this worker id (repeatable)")
    watch.add_argument(
        "--rank", action="append", type=int, default=[], metavar="N", help="only this dp rank (repeatable)"
    )
    watch.add_argument("--heartbeats", action="store_true", help="include heartbeat samples")
    watch.add_argument(
        "--since", type=int, metavar="SEQ", help="resume: replay every kept sample after sequence SEQ first (0: all)"
    )
    watch.add_argument("--incarnation", default="", help="the incarnation SEQ belongs to (refused if it changed)")
    watch.add_argument("--count", type=int, default=0, metavar="N", help="stop after N samples")
    top = _leaf(
        verbs,
        "top",
        "a live table of every rank's latest sample, refreshed like top",
        "[--targets A,B,...] [-d S] [-n N | --once] [--expect W1,W2]",
    )
    top.add_argument("--targets", metavar="A,B,...", help="servers to follow (default: --target)")
    top.add_argument("--interval", "-d", type=float, default=1.0, metavar="S", help="seconds between refreshes")
    top.add_argument("-n", "--iterations", type=int, default=0, metavar="N", help="stop after N frames")
    top.add_argument("--once", dest="iterations", action="store_const", const=1, help="one frame (same as -n 1)")
    top.add_argument(
        "--wait", type=float, default=5.0, metavar="S", help="the first frame waits up to S s for every rank's sample"
    )
    top.add_argument("--stale-after", type=float, default=5.0, metavar="S", help="a rank silent this long is STALE")
    top.add_argument("--expect", metavar="W1,W2", help="expected worker ids: show the planner's verdict")


def parser() -> argparse.ArgumentParser:
    """The parser of every client command."""
    top = argparse.ArgumentParser(
        prog="enginectl",
        usage="enginectl [global flags] COMMAND VERB [flags]",
        description=DESCRIPTION,
        epilog=f"{EPILOG}\n\n{EXAMPLES}",
        formatter_class=_Formatter,
    )
    top.add_argument("--version", action="version", version=f"enginectl {enginectl.__version__}")
    _global_flags(top, suppress=False)
    top.set_defaults(resource=None, help_of=top)  # no command: print this help (kubectl does)
    sub = top.add_subparsers(dest="resource", metavar="COMMAND", title="commands", prog="enginectl")
    _version_commands(sub)
    _weights_commands(sub)
    _generation_commands(sub)
    _operation_commands(sub)
    _identity_commands(sub)
    _fpm_commands(sub)
    add_fleet_commands(sub, _group, _leaf)
    add_gateway_commands(sub, _group, _leaf)
    serve = sub.add_parser(
        "serve", help="run a server (not a client command): `enginectl serve --help`", add_help=False
    )
    serve.add_argument("rest", nargs=argparse.REMAINDER)
    return top
