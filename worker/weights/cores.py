"""Which cores enginectl's own threads inside a vLLM worker may run on.

Runs inside every vLLM worker process. vLLM's CPU worker binds its thread to the cores its
OpenMP threads compute on (on a 2-core machine: core 0, leaving the other core to the
EngineCore and the API server), and every thread started from it inherits that binding.
enginectl's background threads in the worker do not compute: they move bytes (gloo's I/O
threads and the broadcast receive thread, ZMQ's I/O thread, the staging thread). Bound to the
worker's cores they take turns with what they feed: the load during an update, generation
while a stage runs. Allowed on every core the engine may use, they run beside it
(docs/weights.md, "Threads and the weights"). The model's own work is never moved.

Linux keeps a CPU mask per thread: `unbind_this_thread` changes only the calling thread's,
and `unbound` lets the RPC thread start threads (gloo's, ZMQ's) that inherit the wider mask,
then gives the RPC thread its own back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def engine_cores() -> set[int]:
    """The cores this thread, its process or the engine process that started it may use."""
    cores = set(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        cores |= set(os.sched_getaffinity(os.getpid()))
        cores |= set(os.sched_getaffinity(os.getppid()))
    return cores


def unbind_this_thread() -> None:
    """Allow the calling thread (a background thread of enginectl) on every engine core."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, engine_cores())


@contextlib.contextmanager
def unbound() -> Iterator[None]:
    """Run the body with the calling thread allowed on every engine core, so that threads it
    starts inherit that mask; the calling thread's own mask is restored after."""
    try:
        own = os.sched_getaffinity(0)
    except (OSError, AttributeError):  # not Linux: nothing is bound
        yield
        return
    unbind_this_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, own)
