"""`enginectl gateway register|status|deregister --gateway URL`: this server's row in the SMG
gateway, from a terminal or a script (docs/cli.md, "gateway").

Runs in the `enginectl` process. `register` reads the server over gRPC (its declared version,
its incarnation) and builds the registration `enginectl serve --gateway` sends
(common/gateway.py), prints it (the token redacted) and sends it; `status` prints SMG's row
for the server and whether its `weight_version` is the server's declared version;
`deregister` deletes the row. SMG's failures map onto the exit codes of cli/exit_codes.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import enginectl
from enginectl.cli.exit_codes import ExitCode
from enginectl.cli.output import Output, fields
from enginectl.client.client import ChannelOptions, Client
from enginectl.client.trainer import TrainerClient
from enginectl.common.gateway import (
    OWN_LABELS,
    VERSION_LABEL,
    GatewayError,
    Registration,
    SmgWorkers,
    registration,
    url_host,
    version_labels,
)

GATEWAY_ENV = "ENGINECTL_GATEWAY"
DEFAULT_HTTP_PORT = 8000  # enginectl serve's --http-port default


def add_commands(sub: Any, group: Any, leaf: Any) -> None:
    """The `gateway` command and its verbs (args.py passes its own helpers)."""
    verbs = group(sub, "gateway", "this server's registration in the SMG gateway (POST/PATCH/DELETE /workers)")
    register = leaf(
        verbs,
        "register",
        "register the server with SMG as `enginectl serve --gateway` does (a URL SMG holds is updated, not duplicated)",
        "--gateway URL [--http-port P] [--advertise-host H] [--dry-run]",
    )
    register.add_argument("--dry-run", action="store_true", help="print the registration, send nothing")
    status = leaf(
        verbs, "status", "SMG's row for the server, and whether it names the declared version", "--gateway URL"
    )
    deregister = leaf(verbs, "deregister", "remove the server's row from SMG", "--gateway URL")
    for parser in (register, status, deregister):
        parser.add_argument(
            "--gateway",
            metavar="URL",
            default=os.environ.get(GATEWAY_ENV),
            help=f"SMG's HTTP address, e.g. http://10.0.0.5:30000 (${GATEWAY_ENV})",
        )
        parser.add_argument(
            "--gateway-token-file", metavar="FILE", help="bearer token of SMG's control plane (its admin key)"
        )
        parser.add_argument(
            "--advertise-host",
            metavar="H",
            help="the host SMG reaches the server on (default: the host of --target)",
        )
        parser.add_argument(
            "--http-port",
            type=int,
            default=DEFAULT_HTTP_PORT,
            metavar="P",
            help=f"the server's HTTP port, the RL routes' rl.control_url (default {DEFAULT_HTTP_PORT})",
        )


def _target_address(args: argparse.Namespace) -> tuple[str, int]:
    host, _, port = str(args.target).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--target {args.target!r} is not HOST:PORT")
    return (args.advertise_host or host.strip("[]")), int(port)


def _gateway(args: argparse.Namespace) -> SmgWorkers:
    """SMG's client; OSError when the token file cannot be read."""
    token = None
    if args.gateway_token_file:
        with open(args.gateway_token_file) as f:
            token = f.read().strip() or None
    return SmgWorkers(args.gateway, token, timeout=args.timeout)


def _exit_code(err: GatewayError) -> ExitCode:
    if err.unreachable:
        return ExitCode.UNAVAILABLE
    if err.status in (401, 403):
        return ExitCode.AUTH
    if err.status == 409:
        return ExitCode.CONFLICT
    return ExitCode.ERROR


def _report(err: GatewayError) -> int:
    print(f"enginectl: gateway: {err}", file=sys.stderr)
    if err.unreachable:
        print("  hint: is SMG listening there? (--gateway, $ENGINECTL_GATEWAY)", file=sys.stderr)
    elif err.status == 401:
        print("  hint: SMG's control plane needs its key: --gateway-token-file FILE", file=sys.stderr)
    return _exit_code(err)


def _checked(args: argparse.Namespace) -> tuple[SmgWorkers, str, int] | None:
    """SMG's client and the server's advertised host and gRPC port; None (after saying why)
    when the flags cannot be used."""
    if not args.gateway:
        print(f"enginectl: gateway: --gateway URL (or ${GATEWAY_ENV}) is required", file=sys.stderr)
        return None
    try:
        return (_gateway(args), *_target_address(args))
    except (OSError, ValueError) as err:
        print(f"enginectl: gateway: {err}", file=sys.stderr)
        return None


def _registration(args: argparse.Namespace, options: ChannelOptions, host: str, grpc_port: int) -> Registration:
    """What the server would register, read from it now."""
    with Client(args.target, **options) as client:
        state = client.get_weight_version()
    with TrainerClient(args.target, **options) as trainer:
        info = trainer.get_server_info()
    return registration(
        host=host,
        grpc_port=grpc_port,
        http_port=args.http_port,
        token=options.get("token"),
        declared=state.declared,
        version=state.version,
        enginectl_version=enginectl.__version__,  # this CLI's: GetServerInfo's is not in the client's ServerInfo
        incarnation=info.incarnation,
    )


def register(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    checked = _checked(args)
    if checked is None:
        return ExitCode.USAGE
    workers, host, grpc_port = checked
    reg = _registration(args, options, host, grpc_port)
    document: dict[str, Any] = {"gateway": args.gateway, "registration": reg.redacted()}
    if reg.unrepresentable_version is not None:
        document["unrepresentable_version"] = reg.unrepresentable_version
    if args.dry_run:
        out.show(document | {"dry_run": True}, lambda d: _registration_view(d))
        return ExitCode.OK
    try:
        worker_id = workers.register(reg)
    except GatewayError as err:
        return _report(err)
    out.show(document | {"worker_id": worker_id}, lambda d: _registration_view(d))
    return ExitCode.OK


def status(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    checked = _checked(args)
    if checked is None:
        return ExitCode.USAGE
    workers, host, grpc_port = checked
    url = f"grpc://{url_host(host)}:{grpc_port}"
    with Client(args.target, **options) as client:
        state = client.get_weight_version()
    expected = version_labels(state.declared, state.version)
    try:
        row = workers.find_by_url(url)
    except GatewayError as err:
        return _report(err)
    document: dict[str, Any] = {
        "gateway": args.gateway,
        "url": url,
        "registered": row is not None,
        "declared_version": state.version if state.declared else None,
        "expected_label": expected.version,
        "unrepresentable": expected.unrepresentable,
    }
    if row is not None:
        labels = row.get("labels") or {}
        document |= {
            "worker_id": row.get("id"),
            "status": row.get("status"),
            "healthy": row.get("is_healthy"),
            "weight_version": labels.get(VERSION_LABEL),
            "labels": {k: labels[k] for k in OWN_LABELS if k in labels},
            "matches": labels.get(VERSION_LABEL) == expected.version,
        }
    out.show(document, _status_view)
    if row is None:
        print(f"enginectl: gateway: {args.gateway} holds no worker at {url}", file=sys.stderr)
    return ExitCode.OK if row is not None and document["matches"] else ExitCode.ERROR


def deregister(args: argparse.Namespace, options: ChannelOptions, out: Output) -> int:
    checked = _checked(args)
    if checked is None:
        return ExitCode.USAGE
    workers, host, grpc_port = checked
    url = f"grpc://{url_host(host)}:{grpc_port}"
    try:
        row = workers.find_by_url(url)
        if row is None:
            print(f"enginectl: gateway: {args.gateway} holds no worker at {url}", file=sys.stderr)
            return ExitCode.ERROR
        workers.deregister(str(row["id"]))
    except GatewayError as err:
        return _report(err)
    out.show({"gateway": args.gateway, "url": url, "worker_id": row["id"], "deregistered": True}, _deregistered_view)
    return ExitCode.OK


# --- views ---------------------------------------------------------------------------------


def _registration_view(document: dict[str, Any]) -> str:
    reg = document["registration"]
    pairs: list[tuple[str, object]] = [("Gateway", document["gateway"]), ("URL", reg["url"])]
    if "worker_id" in document:
        pairs.append(("Worker id", document["worker_id"]))
    if document.get("dry_run"):
        pairs.append(("Sent", "no (--dry-run)"))
    pairs.append(("API key", reg.get("api_key")))
    pairs += [(f"Label {k}", v) for k, v in reg["labels"].items()]
    if "unrepresentable_version" in document:
        pairs.append(("Unrepresentable", document["unrepresentable_version"]))
    return fields(pairs)


def _status_view(document: dict[str, Any]) -> str:
    pairs: list[tuple[str, object]] = [("Gateway", document["gateway"]), ("URL", document["url"])]
    if not document["registered"]:
        return fields([*pairs, ("Registered", False)])
    declared = document["declared_version"]
    pairs += [
        ("Worker id", document["worker_id"]),
        ("Status", document["status"]),
        ("Healthy", document["healthy"]),
        ("Weight version", repr(document["weight_version"])),
        ("Declared", declared if declared is not None else "<undeclared>"),
        ("Matches", document["matches"]),
    ]
    if document["unrepresentable"]:
        pairs.append(("Unrepresentable", "the declared version is not SMG syntax: the label is cleared"))
    pairs += [(f"Label {k}", v) for k, v in document["labels"].items()]
    return fields(pairs)


def _deregistered_view(document: dict[str, Any]) -> str:
    return f"{document['worker_id']}: deregistered from {document['gateway']}"
