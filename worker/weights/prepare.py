"""Prepare before write: can this worker read every file a disk update planned, as planned?

Runs inside a vLLM worker, on its RPC thread, within one PREPARE worker RPC
(extension.py `enginectl_prepare`), before the server pauses generation or sends the LOAD or
STAGE (DESIGN §13, "Prepare before write"). The server planned the update from the headers it
read on its own host; a rank on another node may see no such file, another file under that
name, or a copy cut short. Each worker opens every planned file and compares its safetensors
header with the planned one (names, dtypes, shapes, data offsets), and that the file is long
enough for every tensor's bytes: the 8-byte length, the JSON header and one fstat per file,
never a tensor's bytes. Torch-free, and never blocks: a FIFO is opened non-blocking and
refused from its fstat, as the server does (server/weights/sources/disk.py `open_regular`).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import time

from enginectl.common.host import host_identity
from enginectl.common.safetensors_header import HeaderEntry, HeaderError, parse_header
from enginectl.contract.prepare import PlannedFile, PlannedTensor, Prepared, PreparePlan, PrepareProblem

# The longest header read (as the server's MAX_HEADER_BYTES, server/limits.py): a length past
# it is no header the server could have planned from.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)
_NOT_REGULAR = (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP)  # a socket, a device without a driver


class Unprepared(Exception):
    """A planned file this worker can not read as planned: why, in the contract's words."""

    def __init__(self, problem: PrepareProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def prepare(plan: PreparePlan, dp_rank: int, worker_rank: int) -> Prepared:
    """This worker's answer to PREPARE: the first planned file it can not read as planned, and
    why (never raises)."""
    started = time.monotonic()
    hostname = host_identity().hostname
    for file in plan.files:
        try:
            check_file(file)
        except Unprepared as exc:
            return Prepared(
                dp_rank, worker_rank, hostname, time.monotonic() - started, exc.problem, file.path, str(exc)
            )
    return Prepared(dp_rank, worker_rank, hostname, time.monotonic() - started)


def check_file(file: PlannedFile) -> None:
    """Unprepared unless `file.path` is a regular file here whose header holds exactly the
    planned tensors, where they were planned, and that is long enough for all of them."""
    fd = _open(file.path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unprepared(
                PrepareProblem.NOT_REGULAR, f"{file.path} is not a regular file here ({_kind(info.st_mode)})"
            )
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise Unprepared(
                PrepareProblem.NOT_SAFETENSORS, f"{file.path}: {info.st_size} bytes, no safetensors header"
            )
        (length,) = struct.unpack("<Q", head)
        if length < 2 or length > MAX_HEADER_BYTES or 8 + length > info.st_size:
            raise Unprepared(
                PrepareProblem.NOT_SAFETENSORS,
                f"{file.path}: its header says {length} bytes, the file holds {info.st_size}: truncated or not safetensors",
            )
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise Unprepared(PrepareProblem.UNREADABLE, f"{file.path} can not be read here: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        entries = parse_header(raw, file.path)
    except HeaderError as exc:
        raise Unprepared(PrepareProblem.NOT_SAFETENSORS, str(exc)) from None
    difference = header_difference(file.tensors, entries)
    if difference:
        raise Unprepared(PrepareProblem.HEADER_DIFFERS, f"{file.path}: {difference}")
    data = info.st_size - 8 - length
    last = max(entries, key=lambda e: e.end)
    if last.end > data:
        raise Unprepared(
            PrepareProblem.TRUNCATED,
            f"{file.path}: tensor {last.name!r} ends at byte {last.end} of the data, the file holds {data}",
        )


def header_difference(planned: tuple[PlannedTensor, ...], found: list[HeaderEntry]) -> str:
    """How the header `found` here differs from the `planned` one, first difference first
    ("" when they hold the same tensors, dtypes, shapes and offsets)."""
    here = {e.name: e for e in found}
    names = {t.name for t in planned}
    for want in planned:
        got = here.get(want.name)
        if got is None:
            return f"tensor {want.name!r} is planned but not in the header here"
        if got.dtype != want.dtype:
            return f"tensor {want.name!r} is {got.dtype} here, {want.dtype} as planned"
        if got.shape != tuple(want.shape):
            return f"tensor {want.name!r} has shape {list(got.shape)} here, {list(want.shape)} as planned"
        if (got.begin, got.end) != (want.begin, want.end):
            return (
                f"tensor {want.name!r} lies at data bytes [{got.begin}, {got.end}) here, "
                f"[{want.begin}, {want.end}) as planned"
            )
    extra = [e.name for e in found if e.name not in names]
    if extra:
        return f"tensor {extra[0]!r} is in the header here but was not planned ({len(extra)} such)"
    return ""


def _open(path: str) -> int:
    """A descriptor of `path` for reading, opened without blocking (a FIFO opens at once)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno in _MISSING:
            raise Unprepared(PrepareProblem.MISSING, f"{path} does not exist here") from None
        if exc.errno in _NOT_REGULAR:
            raise Unprepared(PrepareProblem.NOT_REGULAR, f"{path} is not a regular file here") from None
        raise Unprepared(PrepareProblem.UNREADABLE, f"{path} can not be opened here: {exc.strerror}") from None


_KINDS = (
    (stat.S_ISFIFO, "a fifo"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")
