"""The client commands of `enginectl`: they talk to a server, and need only `pip install enginectl`.

The `enginectl` command itself is `enginectl.cli.main`: it runs `serve` (the server extra) and
hands every other command to `main` here, which never imports the server. The command line
is args.py, what is printed output.py and views.py, exit codes and error reports
exit_codes.py, the fleet commands fleet.py, the gateway commands gateway.py, the metrics commands watch.py and top.py;
docs/cli.md is the manual.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

from enginectl.cli import fleet, gateway
from enginectl.cli.args import parser
from enginectl.cli.exit_codes import ExitCode, exit_code, report
from enginectl.cli.output import Output, human_bytes
from enginectl.cli.top import run_top
from enginectl.cli.views import VERSION_COLUMNS, operations_table, render, version_row
from enginectl.cli.watch import watch
from enginectl.client.client import ChannelConfig, ChannelOptions, Client
from enginectl.client.errors import EnginectlError
from enginectl.client.trainer import TrainerClient

SERVE_ELSEWHERE = (
    "enginectl: `serve` is not a client command: use the `enginectl` console script "
    "(enginectl.cli), which runs the server when the `server-cpu` extra is installed"
)


class UsageError(Exception):
    """A flag's value cannot be used (e.g. an unreadable file); nothing was sent."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise UsageError(f"cannot read the {what} {path}: {err.strerror}") from None


def channel_options(args: argparse.Namespace) -> ChannelOptions:
    """The client options the global flags (and $ENGINECTL_TOKEN) ask for."""
    options: ChannelOptions = {"timeout": args.timeout}
    token = os.environ.get("ENGINECTL_TOKEN")
    if args.token_file:
        token = _read(args.token_file, "token file").decode().strip()
    options["token"] = token or None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls or args.tls_ca or args.tls_cert:
        options["tls"] = True
        if args.tls_ca:
            options["root_certificates"] = _read(args.tls_ca, "CA file")
        if args.tls_cert:
            options["client_certificate"] = _read(args.tls_cert, "certificate file")
            options["client_key"] = _read(args.tls_key, "key file")
    return options


class Commands:
    """One method per `COMMAND VERB`; each prints its result and returns the exit code."""

    def __init__(self, args: argparse.Namespace, options: ChannelOptions, out: Output) -> None:
        self.args, self.options, self.out = args, options, out

    def run(self) -> int:
        method: Callable[[], int | None] = getattr(self, f"{self.args.resource}_{self.args.verb}")
        return method() or ExitCode.OK

    def _client(self) -> Client:
        return Client(self.args.target, **self.options)

    def _trainer(self) -> TrainerClient:
        return TrainerClient(self.args.target, **self.options)

    # --- version ----------------------------------------------------------------------
    def version_get(self) -> None:
        with self._client() as c:
            self.out.show(c.get_weight_version(), render)

    def version_set(self) -> None:
        a = self.args
        with self._client() as c:
            self.out.show(c.set_weight_version(a.version, etag=a.etag, request_id=a.request_id), render)

    def version_watch(self) -> None:
        a = self.args
        with self._client() as c:
            for state in c.watch_weight_version(since_revision=a.since_revision, incarnation=a.incarnation):
                self.out.event(state, VERSION_COLUMNS, version_row)

    # --- weights ----------------------------------------------------------------------
    def weights_load(self) -> None:
        a = self.args
        with self._trainer() as t:
            result = t.update_weights_from_disk(a.path, a.version, **self._apply_options())
        self.out.show(result, render)

    def weights_stage(self) -> None:
        a = self.args
        with self._trainer() as t:
            staged = t.stage_weights_from_disk(
                a.path, a.version, timeout=a.update_timeout, progress=sys.stderr.isatty()
            )
        self.out.show(staged, render)

    def weights_commit(self) -> int:
        a = self.args
        with self._trainer() as t:
            name = self._staged_name(t)
            if name is None:
                return ExitCode.ERROR
            result = t.commit_staged_weights(name, a.version, **self._apply_options())
        self.out.show(result, render)
        return ExitCode.OK

    def weights_discard(self) -> int:
        with self._trainer() as t:
            name = self._staged_name(t)
            if name is None:
                return ExitCode.ERROR
            freed = t.discard_staged_weights(name)
        self.out.show({"name": name, "bytes_freed": freed}, lambda _: f"{name}: discarded, {human_bytes(freed)} freed")
        return ExitCode.OK

    def _apply_options(self) -> dict[str, Any]:
        """The keyword arguments of `weights load` and `weights commit` (args.py `_apply_flags`)."""
        a = self.args
        return {
            "etag": a.etag,
            "pause_mode": a.pause_mode,
            "reset_prefix_cache": not a.keep_prefix_cache,
            "timeout": a.update_timeout,
            "progress": sys.stderr.isatty(),
            "wait": not a.no_wait,
        }

    def _staged_name(self, t: TrainerClient) -> str | None:
        """The staged set the command names, else the one the server holds (at most one); None
        after saying there is none."""
        if self.args.name:
            return str(self.args.name)
        staged = t.generation_state().staged
        if staged is None:
            print("enginectl: the server holds no staged set (enginectl weights stage PATH makes one)", file=sys.stderr)
            return None
        return staged.name

    def weights_verify(self) -> None:
        with self._trainer() as t:
            self.out.show(t.verify_weights(full=self.args.full), render)

    def weights_info(self) -> None:
        with self._trainer() as t:
            self.out.show(t.get_server_info(), render)

    # --- generation -------------------------------------------------------------------
    def generation_state(self) -> None:
        with self._trainer() as t:
            self.out.show(t.generation_state(), render)

    def generation_pause(self) -> None:
        with self._trainer() as t:
            self.out.show(t.pause_generation(self.args.mode), render)

    def generation_resume(self) -> None:
        with self._trainer() as t:
            self.out.show(t.resume_generation(force=self.args.force), render)

    # --- operation --------------------------------------------------------------------
    def operation_get(self) -> None:
        with self._trainer() as t:
            self.out.show(t.get_operation(self.args.name), render)

    def operation_list(self) -> None:
        with self._trainer() as t:
            ops = t.list_operations(done=self.args.done)
        if self.out.json:
            for op in ops:  # a line per operation, as a stream's events
                self.out.show(op, render)
        else:
            self.out.show(ops, operations_table)

    def operation_wait(self) -> int:
        with self._trainer() as t:
            op = t.wait_operation(self.args.name, self.args.wait_timeout)
        self.out.show(op, render)
        if not op.done:
            print(f"enginectl: {op.name} still running after {self.args.wait_timeout:g}s", file=sys.stderr)
            return ExitCode.DEADLINE
        if op.error is not None:
            print(report(op.error, self.args.target), file=sys.stderr)
            return exit_code(op.error)
        return ExitCode.OK

    def operation_cancel(self) -> None:
        name = self.args.name
        with self._trainer() as t:
            t.cancel_operation(name)
        self.out.show({"name": name, "cancel_requested": True}, lambda _: f"{name}: cancel requested")

    # --- identity ---------------------------------------------------------------------
    def identity_get(self) -> None:
        with self._client() as c:
            self.out.show(c.get_worker_identity(rank_timeout=self.args.rank_timeout), render)

    def identity_set(self) -> None:
        a = self.args
        with self._client() as c:
            self.out.show(c.set_worker_identity(a.worker_id, rank_timeout=a.rank_timeout), render)

    # --- fleet ------------------------------------------------------------------------
    def fleet_status(self) -> int:
        return fleet.status(self.args, self.options, self.out)

    def fleet_update(self) -> int:
        return fleet.update(self.args, self.options, self.out)

    def fleet_verify(self) -> int:
        return fleet.verify(self.args, self.options, self.out)

    def fleet_repair(self) -> int:
        return fleet.repair(self.args, self.options, self.out)

    # --- gateway ----------------------------------------------------------------------
    def gateway_register(self) -> int:
        return gateway.register(self.args, self.options, self.out)

    def gateway_status(self) -> int:
        return gateway.status(self.args, self.options, self.out)

    def gateway_deregister(self) -> int:
        return gateway.deregister(self.args, self.options, self.out)

    # --- fpm --------------------------------------------------------------------------
    def fpm_watch(self) -> None:
        a = self.args
        config = ChannelConfig(a.target, **self.options)
        watch(
            config,
            self.out,
            worker_ids=a.worker,
            dp_ranks=a.rank,
            heartbeats=a.heartbeats,
            since=a.since,
            incarnation=a.incarnation,
            count=a.count,
        )

    def fpm_top(self) -> int:
        a = self.args
        targets = fleet.targets(a)
        expect = fleet.comma_list(a.expect)
        if not targets or a.interval <= 0 or a.iterations < 0:
            raise UsageError("fpm top needs --targets, an --interval above 0 and -n of 0 or more")
        configs = [ChannelConfig(t, **self.options) for t in targets]
        connected = asyncio.run(
            run_top(
                configs,
                self.out,
                interval=a.interval,
                iterations=a.iterations,
                wait=a.wait,
                stale_after=a.stale_after,
                expect=expect,
            )
        )
        return ExitCode.OK if connected else ExitCode.UNAVAILABLE


def main(argv: list[str] | None = None) -> int:
    """The client commands of `enginectl` (`enginectl --help`); `serve` is `enginectl.cli.main`'s."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        print(SERVE_ELSEWHERE, file=sys.stderr)
        return ExitCode.USAGE
    args = parser().parse_args(argv)
    if args.resource == "serve":
        print("enginectl: `serve` comes first, its flags after it: enginectl serve [flags]", file=sys.stderr)
        return ExitCode.USAGE
    if args.resource is None or args.verb is None:
        args.help_of.print_help()
        return ExitCode.OK
    try:
        return Commands(args, channel_options(args), Output(args.output)).run()
    except UsageError as err:
        print(f"enginectl: {err}", file=sys.stderr)
        return ExitCode.USAGE
    except EnginectlError as err:
        print(report(err, args.target), file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
