"""`engine_ipc_dir` (server/engine_processes.py): vLLM's ipc sockets go to a directory of the
server's own, removed once its children are gone, so a run leaves no socket file in the temp
directory. A real `enginectl serve` is checked in tests/e2e/test_serve_blackbox.py (its last
test); here a child process stands in for an EngineCore: it binds a real ZMQ ipc socket where
vLLM would (`$VLLM_RPC_BASE_PATH/<uuid>`) and leaves by os._exit, as vLLM's processes do.

Nothing is faked. monkeypatch only sets the inputs, and puts them back: the temp directory
(`tempfile.tempdir`, which is what $TMPDIR decides once per process, so setting $TMPDIR here
would not reach it) and VLLM_RPC_BASE_PATH, which the function reads and sets in this process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginectl.server.engine_processes import VLLM_IPC_DIR_ENV, engine_ipc_dir

CHILD = """
import os, uuid, zmq
path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4()))
zmq.Context().socket(zmq.PULL).bind("ipc://" + path)
print(path, flush=True)
os._exit(0)
"""


@pytest.fixture
def tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The temp directory, short like /tmp (pytest's own tmp_path is too long to add a level)."""
    short = Path(tempfile.mkdtemp(prefix="ipc-"))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    monkeypatch.delenv(VLLM_IPC_DIR_ENV, raising=False)
    yield short
    shutil.rmtree(short, ignore_errors=True)


def test_a_childs_socket_files_go_with_the_directory(tmp: Path) -> None:
    with engine_ipc_dir() as own:
        assert own is not None and Path(own).parent == tmp and os.environ[VLLM_IPC_DIR_ENV] == own
        assert Path(own).stat().st_mode & 0o777 == 0o700
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
        socket = Path(out.stdout.strip())
        assert socket.parent == Path(own) and socket.is_socket()  # os._exit left it behind
    assert not socket.exists() and not Path(own).exists()
    assert list(tmp.iterdir()) == [] and VLLM_IPC_DIR_ENV not in os.environ


def test_the_users_own_base_path_is_left_alone(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp / "mine"
    mine.mkdir()
    monkeypatch.setenv(VLLM_IPC_DIR_ENV, str(mine))
    with engine_ipc_dir() as own:
        assert own is None and os.environ[VLLM_IPC_DIR_ENV] == str(mine)
    assert mine.is_dir() and os.environ[VLLM_IPC_DIR_ENV] == str(mine)
    assert [p.name for p in tmp.iterdir()] == ["mine"]


def test_a_temp_dir_too_long_for_one_more_level_keeps_vllms_default(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's socket path is the base + "/<uuid>" and must fit 107 bytes: a base that fits
    alone but not with enginectl's directory added is used as it is."""
    deep = tmp / ("d" * (60 - len(str(tmp))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert len(str(deep)) + 37 <= 107 < len(str(deep)) + len("/enginectl-ipc-xxxxxxxx") + 37
    with engine_ipc_dir() as own:
        assert own is None and VLLM_IPC_DIR_ENV not in os.environ
    assert list(deep.iterdir()) == []
