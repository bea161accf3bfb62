"""The client commands of `enginectl`: they talk to a server, and need only `pip install enginectl`.

The `enginectl` command itself is `enginectl.cli.main`: it runs `serve` (the server extra) and
hands every other command to `main` here, which never imports the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime
from typing import TypeAlias

from enginectl.client.client import Client
from enginectl.client.errors import EnginectlError
from enginectl.client.trainer import TrainerClient
from enginectl.client.trainer_types import (
    GenerationState,
    PauseResult,
    ServerInfo,
    UpdateOperation,
    UpdateResult,
    Verification,
)
from enginectl.client.types import WeightVersion

# What a command prints, as one JSON line.
Printable: TypeAlias = (
    UpdateResult | UpdateOperation | Verification | ServerInfo | GenerationState | PauseResult | WeightVersion
)

USAGE = """usage: enginectl serve [vLLM and enginectl flags]   (enginectl serve --help)
       enginectl [--target HOST:PORT] version get
       enginectl [--target HOST:PORT] version set VERSION [--etag ETAG] [--request-id UUID]
       enginectl [--target HOST:PORT] version watch [--since-revision N]
       enginectl [--target HOST:PORT] weights load PATH [--version V] [--pause-mode keep|abort|wait]
                                                 [--keep-prefix-cache] [--update-timeout S] [--no-wait]
       enginectl [--target HOST:PORT] weights verify [--full]
       enginectl [--target HOST:PORT] weights info
       enginectl [--target HOST:PORT] generation state|pause [--mode keep|abort|wait]|resume [--force]
       enginectl [--target HOST:PORT] operation get|wait|cancel NAME
"""


def _json(value: Printable) -> str:
    def default(obj: object) -> str:
        if isinstance(obj, datetime):
            return obj.isoformat()
        return str(obj)

    return json.dumps(asdict(value), default=default)


def _client_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="enginectl", usage=USAGE)
    parser.add_argument("--target", default=os.environ.get("ENGINECTL_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--token-file", default=None, help="bearer token file (or $ENGINECTL_TOKEN)")
    parser.add_argument("--timeout", type=float, default=30.0)
    sub = parser.add_subparsers(dest="resource", required=True)
    version = sub.add_parser("version", help="the weight version").add_subparsers(dest="verb", required=True)
    version.add_parser("get")
    set_ = version.add_parser("set")
    set_.add_argument("version")
    set_.add_argument("--etag", default=None)
    set_.add_argument("--request-id", default=None)
    watch = version.add_parser("watch")
    watch.add_argument("--since-revision", type=int, default=None)
    weights = sub.add_parser("weights", help="load and verify weights").add_subparsers(dest="verb", required=True)
    load = weights.add_parser("load", help="UpdateWeightsFromDisk (a path on the server), with a progress bar")
    load.add_argument("path")
    load.add_argument("--version", default=None, help="declare this version on success (else: undeclared)")
    load.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep")
    load.add_argument("--keep-prefix-cache", action="store_true", help="do not reset the prefix cache")
    load.add_argument("--update-timeout", type=float, default=None, help="seconds the update may take")
    load.add_argument("--no-wait", action="store_true", help="print the running operation and return")
    weights.add_parser("verify", help="VerifyWeights").add_argument("--full", action="store_true")
    weights.add_parser("info", help="GetServerInfo")
    generation = sub.add_parser("generation", help="pause and resume").add_subparsers(dest="verb", required=True)
    generation.add_parser("state")
    generation.add_parser("pause").add_argument("--mode", choices=("keep", "abort", "wait"), default="keep")
    generation.add_parser("resume").add_argument(
        "--force", action="store_true", help="resume even over a partial update's mixed weights"
    )
    operation = sub.add_parser("operation", help="weight-update operations").add_subparsers(dest="verb", required=True)
    for verb in ("get", "wait", "cancel"):
        operation.add_parser(verb).add_argument("name")
    return parser


def _trainer_command(client: TrainerClient, args: argparse.Namespace) -> Printable | None:
    """Run a weights/generation/operation command; returns what to print (or None)."""
    if args.resource == "weights":
        if args.verb == "load":
            return client.update_weights_from_disk(
                args.path,
                args.version,
                pause_mode=args.pause_mode,
                reset_prefix_cache=not args.keep_prefix_cache,
                timeout=args.update_timeout,
                progress=sys.stderr.isatty(),
                wait=not args.no_wait,
            )
        if args.verb == "verify":
            return client.verify_weights(full=args.full)
        return client.get_server_info()
    if args.resource == "generation":
        if args.verb == "state":
            return client.generation_state()
        if args.verb == "pause":
            return client.pause_generation(args.mode)
        return client.resume_generation(force=args.force)
    if args.verb == "get":
        return client.get_operation(args.name)
    if args.verb == "wait":
        return client.wait_operation(args.name)
    client.cancel_operation(args.name)
    return None


def main(argv: list[str] | None = None) -> int:
    """The client commands of `enginectl` (see USAGE); `serve` is `enginectl.cli.main`'s."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        print(
            "enginectl: `serve` is not a client command: use the `enginectl` console script "
            "(enginectl.cli), which runs the server when the `server-cpu` extra is installed",
            file=sys.stderr,
        )
        return 2
    args = _client_parser().parse_args(argv)
    token = os.environ.get("ENGINECTL_TOKEN")
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    try:
        if args.resource != "version":
            with TrainerClient(args.target, token=token, timeout=args.timeout) as trainer:
                result = _trainer_command(trainer, args)
            if result is not None:
                print(_json(result))
            return 0
        with Client(args.target, token=token, timeout=args.timeout) as client:
            if args.verb == "get":
                print(_json(client.get_weight_version()))
            elif args.verb == "set":
                print(_json(client.set_weight_version(args.version, etag=args.etag, request_id=args.request_id)))
            else:
                for state in client.watch_weight_version(since_revision=args.since_revision):
                    print(_json(state), flush=True)
    except EnginectlError as err:
        print(f"enginectl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
