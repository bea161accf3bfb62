"""The `enginectl` client commands as an operator runs them: real `enginectl` subprocesses.

- help and `--version`; tables on a terminal (the child's stdout on a pseudo-terminal) and
  JSON otherwise; exit codes that say what failed, with the reason on stderr;
- `identity set` making an `--await-worker-id` server serve, `fpm watch` resuming, `fpm top`
  drawing and updating a row per rank, `weights load` with per-rank results.

Servers: the session `server` (one rank); one module server with data_parallel_size=2
started with `--await-worker-id` (its tests run in file order: the identity test makes it
serve); control planes without an engine in this process for the token and TLS cases.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import termios
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pki import Pki
from support.serving import BIN, READY_TIMEOUT_S, ServeProcess, base_env
from support.weights import Checkpoints, stop_server

import enginectl
from enginectl.client import Client
from enginectl.server.grpc_server import ControlPlaneServer, TlsConfig
from enginectl.server.weights.version.ledger import WeightVersionLedger

ENGINECTL = str(BIN / "enginectl")
ENV = base_env()  # no $ENGINECTL_TOKEN
CLEAR = "\x1b[H\x1b[2J"
WORKER = "w-cli"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT_S = 120.0


# -- running the command ----------------------------------------------------------------------
def cli(
    target: str | None, *words: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`enginectl [--target T] WORDS`, stdout and stderr on pipes (not a terminal)."""
    argv = [ENGINECTL, *(["--target", target] if target else []), *words]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env or ENV, stdin=subprocess.DEVNULL
    )


@dataclass(frozen=True)
class Shown:
    """What a command run on a terminal showed."""

    code: int
    stdout: str
    stderr: str


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal (parent, child) of 50 x 160, as a terminal window has a size."""
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    return parent, child


def on_terminal(target: str, *words: str, stderr_too: bool = False, timeout: float = TIMEOUT_S) -> Shown:
    """`enginectl --target T WORDS` with stdout (and with `stderr_too` stderr) on a terminal."""
    out_parent, out_child = _terminal()
    err_parent, err_child = _terminal() if stderr_too else (-1, -1)
    proc = subprocess.Popen(
        [ENGINECTL, "--target", target, *words],
        stdin=subprocess.DEVNULL,
        stdout=out_child,
        stderr=err_child if stderr_too else subprocess.PIPE,
        env=ENV,
    )
    os.close(out_child)
    if stderr_too:
        os.close(err_child)
    err_fd = err_parent if proc.stderr is None else proc.stderr.fileno()
    got = {out_parent: b"", err_fd: b""}
    reading = set(got)
    deadline = time.monotonic() + timeout
    try:
        while reading:
            ready, _, _ = select.select(list(reading), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                pytest.fail(f"`enginectl {' '.join(words)}` still running after {timeout}s: {got}")
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the terminal's other side is closed
                    data = b""
                got[fd] += data
                if not data:
                    reading.discard(fd)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for fd in (out_parent, err_parent):
            if fd >= 0:
                os.close(fd)
        if proc.stderr is not None:
            proc.stderr.close()
    out, err = (got[fd].decode().replace("\r\n", "\n") for fd in (out_parent, err_fd))
    return Shown(code, out, err)


def fields(text: str) -> dict[str, str]:
    """`Key:  value` lines of a terminal view."""
    return {m[1]: m[2] for m in re.finditer(r"^([A-Z][A-Za-z ]*):\s+(.*)$", text, re.MULTILINE)}


def rows(text: str, first: str) -> list[list[str]]:
    """Table rows (cells split on spaces) whose first cell is `first`."""
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first]]


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- no server --------------------------------------------------------------------------------
COMMANDS = [
    "version get",
    "version set",
    "version watch",
    "weights load",
    "weights stage",
    "weights commit",
    "weights discard",
    "weights verify",
    "weights info",
    "generation state",
    "generation pause",
    "generation resume",
    "operation get",
    "operation list",
    "operation wait",
    "operation cancel",
    "identity get",
    "identity set",
    "fpm watch",
    "fpm top",
]


def test_help_says_usage_once_and_every_command_has_its_own() -> None:
    top = cli(None, "--help")
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: enginectl ") and "usage: usage:" not in top.stdout
    for section in ("global flags:", "commands:", "exit codes:", "examples:"):
        assert section in top.stdout
    for resource in ("version", "weights", "generation", "operation", "identity", "fpm"):
        assert re.search(rf"^\s+{resource}\s", top.stdout, re.MULTILINE), resource
    helps = {  # every command's own --help, all at once
        command: subprocess.Popen(
            [ENGINECTL, *command.split(), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        for command in COMMANDS
    }
    for command, proc in helps.items():
        out, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, (command, err)
        assert out.startswith(f"usage: enginectl {command} "), out[:200]
        assert "usage: usage:" not in out and "exit codes:" in out


def test_version_flag_prints_the_package_version() -> None:
    shown = cli(None, "--version")
    assert (shown.returncode, shown.stdout) == (0, f"enginectl {enginectl.__version__}\n")


def test_usage_errors_exit_2_before_anything_is_sent(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens: a call would exit 3, not 2
    unknown = cli(target, "version", "frob")
    assert unknown.returncode == 2 and "invalid choice: 'frob'" in unknown.stderr
    missing = cli(target, "identity", "set")
    assert missing.returncode == 2 and "WORKER_ID" in missing.stderr
    token = cli(target, "--token-file", str(tmp_path / "absent"), "version", "set", "v")
    assert token.returncode == 2 and "cannot read the token file" in token.stderr
    half = cli(target, "version", "get", "--tls-cert", str(tmp_path / "cert.pem"))
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stderr


def test_unreachable_target_exits_3_with_a_hint() -> None:
    target = f"127.0.0.1:{free_port()}"
    shown = cli(target, "version", "get")
    assert shown.returncode == 3, shown.stderr
    assert shown.stderr.startswith("enginectl: UNAVAILABLE")
    assert f"hint: is a server listening on {target}?" in shown.stderr and "Traceback" not in shown.stderr


# -- control planes without an engine (token, TLS) ---------------------------------------------
@pytest.fixture
async def token_plane() -> AsyncIterator[str]:
    plane = ControlPlaneServer(WeightVersionLedger(), token="s3cret-token")
    port = await plane.start("127.0.0.1", 0)
    await plane.set_serving(True)
    yield f"127.0.0.1:{port}"
    await plane.stop(0)


async def test_a_missing_or_wrong_token_exits_4_and_the_token_flags_work(token_plane: str, tmp_path: Path) -> None:
    refused = await asyncio.to_thread(cli, token_plane, "version", "set", "no-token")
    assert refused.returncode == 4, refused.stderr
    assert "UNAUTHENTICATED" in refused.stderr and "hint: this call needs the server's token" in refused.stderr
    wrong = await asyncio.to_thread(cli, token_plane, "version", "set", "bad", env={**ENV, "ENGINECTL_TOKEN": "nope"})
    assert wrong.returncode == 4, wrong.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    by_file = await asyncio.to_thread(cli, token_plane, "version", "set", "by-file", "--token-file", str(token_file))
    assert by_file.returncode == 0, by_file.stderr
    by_env = await asyncio.to_thread(
        cli, token_plane, "version", "set", "by-env", env={**ENV, "ENGINECTL_TOKEN": "s3cret-token"}
    )
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["revision"] == json.loads(by_file.stdout)["revision"] + 1


async def test_tls_flags_reach_a_tls_server(pki: Pki, tmp_path: Path) -> None:
    plane = ControlPlaneServer(WeightVersionLedger(), tls=TlsConfig(pki.server_cert, pki.server_key))
    target = f"127.0.0.1:{await plane.start('127.0.0.1', 0)}"
    await plane.set_serving(True)
    try:
        ca = tmp_path / "ca.pem"
        ca.write_bytes(pki.ca)
        got = await asyncio.to_thread(cli, target, "version", "get", "--tls-ca", str(ca))
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["declared"] is False
        plaintext = await asyncio.to_thread(cli, target, "version", "get", "--timeout", "5")
        assert plaintext.returncode == 3, plaintext.stderr
    finally:
        await plane.stop(0)


# -- the session server -----------------------------------------------------------------------
def test_results_are_tables_on_a_terminal_and_json_otherwise(server: ServeProcess) -> None:
    target = server.grpc_target
    set_ = cli(target, "version", "set", f"cli-tty-{uuid.uuid4().hex[:6]}")
    assert set_.returncode == 0, set_.stderr
    declared = json.loads(set_.stdout)  # not a terminal: JSON
    shown = on_terminal(target, "version", "get")
    assert shown.code == 0, shown.stderr
    assert "{" not in shown.stdout
    view = fields(shown.stdout)
    assert (view["Version"], view["Declared"], view["Source"]) == (declared["version"], "true", "DECLARED")
    assert (view["Revision"], view["Etag"]) == (str(declared["revision"]), declared["etag"])
    assert view["Declared at"].endswith("ago)")
    for flag in (["-o", "json"], ["--json"]):  # JSON on a terminal when asked
        forced = on_terminal(target, "version", "get", *flag)
        assert json.loads(forced.stdout) == declared
    table = cli(target, "version", "get", "-o", "table")  # a table through a pipe when asked
    assert fields(table.stdout)["Etag"] == declared["etag"] and "\x1b" not in table.stdout
    info = on_terminal(target, "weights", "info")
    assert fields(info.stdout)["Data parallel"] == "1"
    assert fields(info.stdout)["Managed ranks"] == "0"  # every rank of its engine: its one
    assert fields(info.stdout)["Incarnation"] == server.serving["incarnation"]
    state = on_terminal(target, "generation", "state")
    assert fields(state.stdout)["Paused"] == "false"
    assert "RANK   PAUSED   RUNNING   WAITING" in state.stdout and rows(state.stdout, "0")[0][:2] == ["0", "false"]


def test_a_stale_etag_exits_5_and_says_the_current_one(server: ServeProcess) -> None:
    target = server.grpc_target
    read = json.loads(cli(target, "version", "set", f"cas-{uuid.uuid4().hex[:6]}").stdout)
    winner = json.loads(cli(target, "version", "set", f"cas-{uuid.uuid4().hex[:6]}", "--etag", read["etag"]).stdout)
    loser = cli(target, "version", "set", "cas-loser", "--etag", read["etag"])
    assert loser.returncode == 5, loser.stderr
    assert loser.stderr.startswith("enginectl: ABORTED ETAG_MISMATCH")
    assert f"current_etag: {winner['etag']}" in loser.stderr and f"--etag {winner['etag']}" in loser.stderr
    assert loser.stdout == ""
    assert json.loads(cli(target, "version", "get").stdout) == winner  # nothing changed


def test_other_refusals_exit_with_their_codes(server: ServeProcess) -> None:
    target = server.grpc_target
    missing = cli(target, "operation", "get", "operations/none")
    assert missing.returncode == 1 and "NOT_FOUND OPERATION_NOT_FOUND" in missing.stderr
    # A peer that takes the connection and never answers (a hung server, caused for real):
    # the deadline passes every time, however fast the machine.
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        late = cli(f"127.0.0.1:{port}", "--timeout", "0.5", "version", "get")
    assert late.returncode == 6 and "DEADLINE_EXCEEDED" in late.stderr, late.stderr


def test_fpm_watch_prints_json_lines_and_resumes_after_a_sequence(server: ServeProcess) -> None:
    target, incarnation = server.grpc_target, server.serving["incarnation"]
    live = cli(target, "fpm", "watch", "--heartbeats", "--count", "3")
    assert live.returncode == 0, live.stderr
    samples = [json.loads(line) for line in live.stdout.splitlines()]
    assert len(samples) == 3 and all(s["incarnation"] == incarnation for s in samples)
    assert [s["sequence"] for s in samples] == sorted({s["sequence"] for s in samples})
    # Resumed after the first: the next two again, exactly (no filter: every sample counts).
    resumed = cli(
        target, "fpm", "watch", "--heartbeats", "--since", str(samples[0]["sequence"]), "--incarnation", incarnation,
        "--count", "2",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line) for line in resumed.stdout.splitlines()] == samples[1:]
    elsewhere = cli(target, "fpm", "watch", "--since", "1", "--incarnation", "another-incarnation")
    assert elsewhere.returncode == 1 and "OUT_OF_RANGE INCARNATION_CHANGED" in elsewhere.stderr
    shown = on_terminal(target, "fpm", "watch", "--heartbeats", "--count", "1")
    assert shown.code == 0, shown.stderr
    header, row = shown.stdout.splitlines()
    assert header.split()[:5] == ["SEQUENCE", "TIME", "WORKER", "RANK", "KIND"]
    assert row.split()[4] in ("STEP", "HEARTBEAT") and f"# incarnation {incarnation}" in shown.stderr


# -- a data_parallel_size=2 server started with --await-worker-id ------------------------------
@pytest.fixture(scope="module")
def dp2(serve_env: dict[str, str], checkpoints: Checkpoints) -> Iterator[tuple[ServeProcess, str]]:
    srv = ServeProcess(
        [
            "--data-parallel-size", "2", "--await-worker-id", "--fpm-heartbeat-interval", "0.25",
            "--allow-weights-from", str(checkpoints.root),
        ],
        serve_env,
    ).start()  # fmt: skip
    try:
        event = srv.wait_for_event(lambda e: e.get("event") == "awaiting_worker_id", timeout=READY_TIMEOUT_S)
        yield srv, f"127.0.0.1:{event['grpc_port']}"
    finally:
        stop_server(srv)


@pytest.fixture
def identified(dp2: tuple[ServeProcess, str]) -> str:
    """The dp2 server serving as WORKER (set by the identity test; setting it again is a no-op)."""
    with Client(dp2[1]) as client:
        client.set_worker_identity(WORKER, rank_timeout=60)
    return dp2[1]


@pytest.mark.slow
def test_identity_set_makes_an_await_worker_id_server_serve(dp2: tuple[ServeProcess, str]) -> None:
    srv, target = dp2
    assert health(target) == NOT_SERVING
    before = cli(target, "identity", "get")
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout) == {
        "ranks": [
            {"dp_rank": 0, "worker_id": "", "identity_generation": 0},
            {"dp_rank": 1, "worker_id": "", "identity_generation": 0},
        ],
        "consistent": False,
        "await_worker_id": True,
    }
    done = cli(target, "identity", "set", WORKER, "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "ranks": [
            {"dp_rank": 0, "worker_id": WORKER, "identity_generation": 1},
            {"dp_rank": 1, "worker_id": WORKER, "identity_generation": 1},
        ]
    }
    srv.wait_for_event(lambda e: e.get("event") == "serving", timeout=60)
    assert health(target) == SERVING
    shown = on_terminal(target, "identity", "get")
    assert shown.code == 0, shown.stderr
    assert (fields(shown.stdout)["Consistent"], fields(shown.stdout)["Awaits worker id"]) == ("true", "true")
    assert rows(shown.stdout, "0") == [["0", WORKER, "1"]] and rows(shown.stdout, "1") == [["1", WORKER, "1"]]
    bad = cli(target, "identity", "set", "bad\nid")
    assert bad.returncode == 1 and "INVALID_ARGUMENT WORKER_ID_INVALID" in bad.stderr


@pytest.mark.slow
def test_fpm_top_draws_a_row_per_rank_and_updates_it(identified: str) -> None:
    target = identified
    got = cli(target, "fpm", "top", "-n", "2", "-d", "1", "--wait", "60", "-o", "json")
    assert got.returncode == 0, got.stderr
    frames = [json.loads(line) for line in got.stdout.splitlines()]
    assert len(frames) == 2
    for frame in frames:
        (endpoint,) = frame["endpoints"]
        assert (endpoint["target"], endpoint["connected"], endpoint["data_parallel_size"]) == (target, True, 2)
        assert [(r["endpoint"], r["dp_rank"], r["worker_id"]) for r in frame["ranks"]] == [
            (target, 0, WORKER),
            (target, 1, WORKER),
        ]
        assert all(r["age_s"] is not None and r["kind"] in ("STEP", "HEARTBEAT") for r in frame["ranks"])
    for before, after in zip(frames[0]["ranks"], frames[1]["ranks"], strict=True):
        # A newer sample arrived (heartbeats every 0.25 s), or the same one is a second older.
        assert (after["sequence"], after["age_s"]) != (before["sequence"], before["age_s"])
        assert after["sequence"] >= before["sequence"]

    # On a terminal: the screen is cleared and the frame redrawn, a row per rank each time.
    shown = on_terminal(target, "fpm", "top", "-n", "2", "-d", "0.5", "--wait", "60")
    assert shown.code == 0, shown.stderr
    drawn = shown.stdout.split(CLEAR)
    assert drawn[0] == "" and len(drawn) == 3
    for frame_text in drawn[1:]:
        ranks = [line.split() for line in frame_text.splitlines() if line.startswith(target) and WORKER in line]
        assert [r[2] for r in ranks] == ["0", "1"], frame_text
    assert "WEIGHT VERSION" in drawn[1] and "connected" in drawn[1]

    # Not a terminal, -o table: the frame without escape codes, for logs and scripts.
    once = cli(target, "fpm", "top", "--once", "--wait", "60", "-o", "table", "--expect", WORKER)
    assert once.returncode == 0 and "\x1b" not in once.stdout
    assert len([line for line in once.stdout.splitlines() if line.startswith(target) and WORKER in line]) == 2
    assert "verdict: OK" in once.stdout


@pytest.mark.slow
def test_weights_load_draws_progress_then_per_rank_results(identified: str, checkpoints: Checkpoints) -> None:
    tensors = len(checkpoints.state_dict("A"))
    shown = on_terminal(identified, "weights", "load", str(checkpoints.a), "--version", "cli-a", stderr_too=True)
    assert shown.code == 0, shown.stderr
    assert "weights" in shown.stderr and f"{tensors}/{tensors} tensors" in shown.stderr  # the progress bar
    view = fields(shown.stdout)
    assert view["Weight version"].startswith("cli-a (revision ") and view["Source"] == "DISK"
    assert [r[:2] for r in rows(shown.stdout, "0") + rows(shown.stdout, "1")] == [
        ["0", str(tensors)],
        ["1", str(tensors)],
    ]
    verified = cli(identified, "weights", "verify")
    assert verified.returncode == 0 and json.loads(verified.stdout)["verdict"] == "MATCH"

    # The operation is listed: a JSON line per operation, newest first, or a table row.
    name = view["Operation"]
    listed = cli(identified, "operation", "list")
    assert listed.returncode == 0, listed.stderr
    newest = json.loads(listed.stdout.splitlines()[0])
    assert (newest["name"], newest["done"], newest["progress"]["phase"]) == (name, True, "DONE")
    assert newest["progress"]["weight_version"] == "cli-a" and newest["response"]["operation"] == name
    done = [json.loads(line)["name"] for line in cli(identified, "operation", "list", "--done").stdout.splitlines()]
    assert done[0] == name
    assert cli(identified, "operation", "list", "--running").stdout == ""  # nothing runs now
    shown = on_terminal(identified, "operation", "list")
    assert shown.code == 0, shown.stderr
    assert shown.stdout.startswith("NAME") and rows(shown.stdout, name)[0][1:4] == ["DONE", "DISK", "cli-a"]


def test_weights_stage_then_commit_or_discard_the_set_the_server_holds(
    identified: str, checkpoints: Checkpoints
) -> None:
    """Two-phase from a shell: `weights stage` leaves a set (shown by `generation state`);
    `weights commit` and `weights discard` act on it without being told its name."""
    nothing = cli(identified, "weights", "commit")
    assert nothing.returncode == 1 and "holds no staged set" in nothing.stderr, nothing.stderr
    before = json.loads(cli(identified, "version", "get").stdout)

    staged = cli(identified, "weights", "stage", str(checkpoints.b), "--version", "cli-b")
    assert staged.returncode == 0, staged.stderr
    held = json.loads(staged.stdout)
    assert (held["weight_version"], held["tensors"]) == ("cli-b", len(checkpoints.state_dict("B")))
    assert json.loads(cli(identified, "version", "get").stdout) == before  # nothing applied yet
    state = on_terminal(identified, "generation", "state")
    assert fields(state.stdout)["Staged"] == held["name"]

    committed = cli(identified, "weights", "commit")
    assert committed.returncode == 0, committed.stderr
    result = json.loads(committed.stdout)
    assert result["weight_version"]["version"] == "cli-b" and result["weight_version"]["source"] == "DISK"
    assert json.loads(cli(identified, "weights", "verify").stdout)["verdict"] == "MATCH"
    assert fields(on_terminal(identified, "generation", "state").stdout)["Staged"] == "-"

    again = json.loads(cli(identified, "weights", "stage", str(checkpoints.a)).stdout)
    dropped = cli(identified, "weights", "discard")
    assert dropped.returncode == 0, dropped.stderr
    assert json.loads(dropped.stdout) == {"name": again["name"], "bytes_freed": again["bytes"] * 2}  # 2 ranks
    assert json.loads(cli(identified, "version", "get").stdout)["version"] == "cli-b"
    gone = cli(identified, "weights", "discard", again["name"])
    assert gone.returncode == 1 and "STAGED_WEIGHTS_NOT_FOUND" in gone.stderr
