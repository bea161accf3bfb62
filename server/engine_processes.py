"""The `enginectl serve` process's children: adopting the orphans of a dying EngineCore and
reaping every child at shutdown (server/engine.py EngineAdapter.shutdown calls `reap_children`).

Runs in the `enginectl serve` process, off the event loops (shutdown runs in a thread).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time

import psutil
import structlog

log = structlog.get_logger("enginectl.engine")

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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
