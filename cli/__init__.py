"""The `enginectl` command: `enginectl serve ...` runs a server; every other command talks to one.

`serve` needs the server extra (`pip install 'enginectl[server-cpu]'`) and is
`enginectl.server.serve`; the client commands are `enginectl.cli.commands`, built on the
library `enginectl.client`, and need only `pip install enginectl` (docs/cli.md is their
manual). Each side is imported only when its command runs, so the client commands never
import the server.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `enginectl` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        try:
            from enginectl.server.serve import main as serve_main
        except ImportError as exc:
            print(
                f"enginectl serve needs the server extra ({exc}); pip install 'enginectl[server-cpu]'", file=sys.stderr
            )
            return 2
        return serve_main(argv[1:])
    from enginectl.cli.commands import main as commands_main

    return commands_main(argv)
