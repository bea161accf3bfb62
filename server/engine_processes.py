"""The `enginectl serve` process's children: adopting the orphans of a dying EngineCore,
reaping every child at shutdown (server/engine.py EngineAdapter.shutdown calls `reap_children`)
and removing the IPC socket files they leave (`engine_ipc_dir`).

Runs in the `enginectl serve` process, off the event loops (shutdown runs in a thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import psutil
import structlog

log = structlog.get_logger("enginectl.engine")

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# vLLM puts its ZMQ ipc sockets (frontend <-> EngineCore, EngineCore <-> workers) at
# `$VLLM_RPC_BASE_PATH/<uuid>`, by default in the temp directory.
VLLM_IPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
# A socket's path must fit sockaddr_un.sun_path (108 bytes, NUL included); vLLM adds "/<uuid>".
_UNIX_PATH_MAX = 107 - len("/00000000-0000-0000-0000-000000000000")
_own_ipc_dir: str | None = None


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux): a grandchild orphaned by a
    dying child, such as a vLLM worker whose EngineCore was killed, is re-parented here
    instead of to init, so `reap_children` still finds and stops it. Call before the engine
    starts; returns whether it took effect."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # not Linux
        return False


@contextlib.contextmanager
def engine_ipc_dir() -> Iterator[str | None]:
    """A directory of this process's own (0700) for vLLM's ipc sockets, removed on the way
    out, once every child is reaped. vLLM's EngineCores and workers leave with os._exit, so
    their socket files outlived every run in /tmp (7 for an engine of one rank). Yields the
    directory; None, and nothing changes, when the user set VLLM_RPC_BASE_PATH or the temp
    directory's path is too long for one more level."""
    global _own_ipc_dir
    if os.environ.get(VLLM_IPC_DIR_ENV):
        yield None
        return
    made = tempfile.mkdtemp(prefix="enginectl-ipc-")
    if len(os.fsencode(made)) > _UNIX_PATH_MAX:
        os.rmdir(made)
        yield None
        return
    _own_ipc_dir = made
    os.environ[VLLM_IPC_DIR_ENV] = _own_ipc_dir  # children inherit it
    try:
        yield _own_ipc_dir
    finally:
        os.environ.pop(VLLM_IPC_DIR_ENV, None)
        remove_engine_ipc_dir()


def remove_engine_ipc_dir() -> None:
    """Remove `engine_ipc_dir`'s directory, if this process made one (also called by the exit
    backstop, server/serve.py, which leaves by os._exit after killing every child)."""
    global _own_ipc_dir
    if _own_ipc_dir is not None:
        shutil.rmtree(_own_ipc_dir, ignore_errors=True)
        _own_ipc_dir = None


def reap_children(timeout: float) -> None:
    """Join every child process; terminate, then kill, whatever is still alive; then stop
    multiprocessing's resource tracker, last: it exits only once every process holding its
    pipe (each spawned child, and their children) is gone, so stopping it first would wait
    for a straggler, e.g. a worker orphaned by a killed EngineCore, for as long as it lives."""
    deadline = time.monotonic() + timeout
    for child in multiprocessing.active_children():
        child.join(max(deadline - time.monotonic(), 0.0))
    me = psutil.Process(os.getpid())
    tracker = _resource_tracker_pid()
    _terminate_then_kill([c for c in me.children(recursive=True) if c.pid != tracker], timeout)
    _stop_resource_tracker()
    _terminate_then_kill(me.children(recursive=True), timeout)  # whatever is left (a hung tracker)
    for child in multiprocessing.active_children():  # collect exit codes, no zombies
        child.join(0)


def _terminate_then_kill(processes: list[psutil.Process], timeout: float) -> None:
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        log.warning("killing child process that ignored SIGTERM", pid=process.pid)
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker ignores SIGTERM and only exits when its pipe closes;
    close it now (it then unlinks anything leaked) instead of leaving it behind."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)
    if stop is not None and getattr(tracker, "_pid", None) is not None:
        try:
            stop()
        except (OSError, ChildProcessError):
            pass
