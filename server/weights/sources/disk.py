"""Safetensors checks for disk updates: where a path may lead, what its headers say.

Runs in the `enginectl serve` process, before any weight is touched. Reads only the JSON
header of each file (8-byte length + JSON) and the index; never imports torch, never opens a
pickle, and never opens anything but a regular file: a FIFO, socket or device under an
allowed root is refused from its stat (reading one could block forever or never end).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import grpc

from enginectl.common.safetensors_header import HeaderError, parse_header
from enginectl.contract.prepare import PlannedFile, PlannedTensor
from enginectl.server.errors import ControlPlaneError, FieldViolation, Reason, invalid_field
from enginectl.server.limits import MAX_HEADER_BYTES, MAX_INDEX_BYTES, MAX_PATH_BYTES, MAX_SHAPE_RANK
from enginectl.server.weights.update.plans import TensorInfo

INDEX_SUFFIX = ".safetensors.index.json"


def unsupported(message: str) -> ControlPlaneError:
    return ControlPlaneError(grpc.StatusCode.INVALID_ARGUMENT, Reason.UNSUPPORTED_FORMAT, message)


_FILE_TYPES = (
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "directory"),
)


def _file_type(mode: int) -> str:
    return next((name for test, name in _FILE_TYPES if test(mode)), "special file")


def not_regular(path: Path, mode: int) -> ControlPlaneError:
    """INVALID_ARGUMENT NOT_A_REGULAR_FILE for `path`, whose st_mode is `mode`."""
    kind = _file_type(mode)
    description = f"{path} is a {kind}, not a regular file"
    return ControlPlaneError(
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.NOT_A_REGULAR_FILE,
        description,
        metadata={"file_type": kind, "real_path": str(path)},
        field_violations=[FieldViolation("path", description)],
    )


def open_regular(path: Path, limit: int | None = None) -> tuple[BinaryIO, int]:
    """Open `path` for reading if it is a regular file; returns the handle and its size.

    Never blocks: O_NONBLOCK makes a FIFO swapped in after the caller's stat open at once
    (instead of waiting for a writer), and fstat checks the file actually opened. `limit`:
    UNSUPPORTED_FORMAT when the file is larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket, a device without a driver
            try:
                mode = os.stat(path).st_mode
            except OSError:
                mode = 0
            raise not_regular(path, mode) from None
        raise _os_error(path, exc) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_regular(path, info.st_mode)
        if limit is not None and info.st_size > limit:
            raise unsupported(f"{path.name}: {info.st_size} bytes, over the {limit} allowed")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _os_error(path: Path, exc: OSError) -> ControlPlaneError:
    """A path that can not be stat'ed or opened: NOT_FOUND when it (or a parent) is missing,
    else INTERNAL LOAD_FAILED (e.g. permissions on the server's side)."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG):
        return ControlPlaneError(grpc.StatusCode.NOT_FOUND, Reason.PATH_NOT_FOUND, f"{path} does not exist")
    return ControlPlaneError(grpc.StatusCode.INTERNAL, Reason.LOAD_FAILED, f"{path} can not be read: {exc.strerror}")


def read_header(path: Path) -> list[TensorInfo]:
    """The tensors a safetensors file holds, in file order; refused as `read_planned`."""
    return [TensorInfo(t.name, t.dtype, t.shape) for t in read_planned(path).tensors]


def read_planned(path: Path) -> PlannedFile:
    """A safetensors file's header as an update plans from it (every tensor with its data
    offsets, in file order: what each worker compares its own copy with before the update
    writes, sources/prepare.py); UNSUPPORTED_FORMAT if the file is not safetensors (pickle,
    GGUF, ...), its header is malformed, or it is truncated; NOT_A_REGULAR_FILE if it is a
    FIFO, socket or device."""
    handle, size = open_regular(path)
    with handle:
        head = handle.read(8)
        if len(head) < 8:
            raise unsupported(f"{path.name}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
            raise unsupported(
                f"{path.name}: not a safetensors file (bad header length); "
                "only safetensors is loaded, pickle checkpoints are refused"
            )
        raw = handle.read(length)
    try:
        entries = parse_header(raw, path.name, data_size=size - 8 - length, max_rank=MAX_SHAPE_RANK)
    except HeaderError as exc:
        raise unsupported(str(exc)) from None
    return PlannedFile(str(path), tuple(PlannedTensor(e.name, e.dtype, e.shape, e.begin, e.end) for e in entries))


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def resolve_checkpoint(path: str, allowed_roots: list[Path]) -> list[Path]:
    """The safetensors files `path` (a file, a directory or an index) leads to, each real
    path inside an allowed root and a regular file. Raises PATH_INVALID / PATH_NOT_FOUND /
    PATH_NOT_ALLOWED / NOT_A_REGULAR_FILE / UNSUPPORTED_FORMAT; never reads tensor data."""
    if not path or "\0" in path or len(path.encode()) > MAX_PATH_BYTES or not os.path.isabs(path):
        raise invalid_field(
            Reason.PATH_INVALID, "path", f"an absolute path of at most {MAX_PATH_BYTES} bytes, without NUL"
        )
    roots = [Path(os.path.realpath(root)) for root in allowed_roots]

    def allowed(candidate: Path, directory: bool = False) -> Path:
        """The real path of `candidate`: inside a root, existing, and a regular file (or,
        with `directory`, a directory); checked by stat, without opening it."""
        real = Path(os.path.realpath(candidate))
        if not _inside(real, roots):
            raise ControlPlaneError(
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.PATH_NOT_ALLOWED,
                f"{candidate} resolves to {real}, outside every allowed weight root "
                "(--allow-weights-from; see GetServerInfo.allowed_weight_roots)",
                metadata={"real_path": str(real)},
            )
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise _os_error(candidate, exc) from None
        if not (stat.S_ISREG(mode) or (directory and stat.S_ISDIR(mode))):
            raise not_regular(real, mode)
        return real

    # Check the path itself first: outside the roots is refused before its existence is told.
    target = allowed(Path(path), directory=True)
    if target.is_dir():
        indexes = sorted(target.glob(f"*{INDEX_SUFFIX}"))
        if indexes:
            return _index_files(allowed(indexes[0]), allowed)
        files = sorted(target.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in target.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".ckpt"))
            raise unsupported(
                f"{path}: no .safetensors file"
                + (f" (found {', '.join(others[:5])}: only safetensors is loaded)" if others else "")
            )
        return [allowed(f) for f in files]
    if target.name.endswith(INDEX_SUFFIX):
        return _index_files(target, allowed)
    return [target]


def _index_files(index: Path, allowed: Callable[[Path], Path]) -> list[Path]:
    handle, _ = open_regular(index, MAX_INDEX_BYTES)
    with handle:
        raw = handle.read(MAX_INDEX_BYTES + 1)
    try:
        weight_map = json.loads(raw)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise unsupported(f"{index.name}: not a safetensors index (no weight_map)") from None
    files = []
    for name in names:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise unsupported(f"{index.name}: names a file outside its directory: {name!r}")
        files.append(allowed(index.parent / name))
    return files


def checkpoint_tensors(model: str) -> dict[str, TensorInfo]:
    """The tensors of the checkpoint the engine was started from (names, dtypes, shapes),
    which define what an update may send. Empty if that checkpoint is not local safetensors."""
    directory = Path(model)
    if not directory.is_dir():
        try:
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not a local or cached model: nothing to check against
            return {}
    try:
        files = resolve_checkpoint(str(directory.resolve()), [directory.resolve()])
        return {info.name: info for file in files for info in read_header(file)}
    except ControlPlaneError:
        return {}
