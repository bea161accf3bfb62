"""Exit codes of the client commands and how a failed call is reported on stderr.

Runs in the `enginectl` process. The exit code says what kind of failure it was, chosen by
the gRPC status code (never by message text), so a script can branch on it; the stderr
report names the status code, the stable reason, the ErrorInfo metadata and the bad fields,
as `docs/cli.md` ("Exit codes") describes.
"""

from __future__ import annotations

import enum

import grpc

from enginectl.client.errors import EnginectlError, Reason


class ExitCode(enum.IntEnum):
    """What `enginectl` exits with (docs/cli.md, "Exit codes")."""

    OK = 0
    ERROR = 1  # the server refused or failed the call (invalid argument, not found, ...)
    USAGE = 2  # bad command line or unreadable local file; nothing was sent
    UNAVAILABLE = 3  # cannot connect, or the server/engine is unavailable (shutting down, dead)
    AUTH = 4  # unauthenticated or permission denied: token or certificate missing or wrong
    CONFLICT = 5  # aborted: stale etag, another update in progress; re-read and retry
    DEADLINE = 6  # the deadline passed before the server answered (or an operation finished)
    INTERRUPTED = 130  # Ctrl-C (SIGINT)


_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: ExitCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.AUTH,
    grpc.StatusCode.PERMISSION_DENIED: ExitCode.AUTH,
    grpc.StatusCode.ABORTED: ExitCode.CONFLICT,
    grpc.StatusCode.DEADLINE_EXCEEDED: ExitCode.DEADLINE,
}

EPILOG = """exit codes:
  0    ok
  1    the server refused or failed the call (the reason is printed on stderr)
  2    usage error: bad flags or arguments, unreadable token/certificate file
  3    unavailable: cannot connect, or the server or its engine is going away
  4    unauthenticated or permission denied (--token-file, $ENGINECTL_TOKEN, --tls-*)
  5    conflict (ABORTED): stale --etag, another update in progress; re-read and retry
  6    deadline exceeded (--timeout, or an operation still running)
  130  interrupted (Ctrl-C)"""


def exit_code(err: EnginectlError) -> ExitCode:
    """The exit code for a failed call, by its gRPC status code."""
    return _BY_CODE.get(err.code, ExitCode.ERROR)


def _hint(err: EnginectlError, target: str) -> str | None:
    if err.reason == Reason.ETAG_MISMATCH:
        current = err.metadata.get("current_etag", "<etag>")
        return f"the version changed since it was read: re-read (enginectl version get), then --etag {current}"
    if err.code is grpc.StatusCode.UNAVAILABLE and not err.reason:
        return f"is a server listening on {target}? (--target, $ENGINECTL_TARGET; --tls for a TLS server)"
    if err.code is grpc.StatusCode.UNAUTHENTICATED:
        return "this call needs the server's token: --token-file FILE or $ENGINECTL_TOKEN"
    return None


def report(err: EnginectlError, target: str) -> str:
    """The stderr lines for a failed call: `enginectl: CODE REASON: message`, then the bad
    fields, the ErrorInfo metadata and, for common mistakes, a hint."""
    lines = [f"enginectl: {err}"]
    lines += [f"  field {v.field}: {v.description}" for v in err.field_violations]
    lines += [f"  {key}: {value}" for key, value in sorted(err.metadata.items())]
    hint = _hint(err, target)
    if hint:
        lines.append(f"  hint: {hint}")
    return "\n".join(lines)
