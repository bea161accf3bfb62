"""The `enginectl` command: `serve` runs a server; the other commands talk to one.

`enginectl serve ...` needs the server extra (`pip install 'enginectl[server-cpu]'`); the
client commands need only `pip install enginectl`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime
from typing import Any

USAGE = """usage: enginectl serve [vLLM and enginectl flags]   (enginectl serve --help)
       enginectl [--target HOST:PORT] version get
       enginectl [--target HOST:PORT] version set VERSION [--etag ETAG] [--request-id UUID]
       enginectl [--target HOST:PORT] version watch [--since-revision N]
"""


def _json(value: Any) -> str:
    def default(obj: Any) -> Any:
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        try:
            from enginectl.server.serve import main as serve_main
        except ImportError as exc:
            print(f"enginectl serve needs the server extra ({exc}); pip install 'enginectl[server-cpu]'",
                  file=sys.stderr)
            return 2
        return serve_main(argv[1:])

    from enginectl.client import Client, EnginectlError

    args = _client_parser().parse_args(argv)
    token = os.environ.get("ENGINECTL_TOKEN")
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    try:
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
