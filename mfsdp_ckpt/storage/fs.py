"""Paths for the checkpoint readers and offline writers: a local path or an fsspec URL
(``s3://bucket/prefix``, ``memory://…``, …).

Local paths go through ``os`` (so that ``fsync`` and ``rename`` keep their meaning); URLs through
fsspec, configured the usual fsspec way (e.g. ``FSSPEC_S3_ENDPOINT_URL`` for an S3-compatible
server). Object stores have no directories and no rename: there a checkpoint is committed by
writing ``mfsdp.json`` last, and readers refuse a prefix without it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import posixpath
import shutil
import stat
from typing import IO, Any

from mfsdp_ckpt.errors import OutsideCheckpointError
from mfsdp_ckpt.format.names import member_name_problem
from mfsdp_ckpt.storage.paths import is_url
from mfsdp_ckpt.storage.remote import filesystem, upload
from mfsdp_ckpt.storage.staging import write_file_atomic

__all__ = [
    "is_url",
    "is_local",
    "join",
    "dirname",
    "normalize",
    "exists",
    "lexists",
    "isfile",
    "isdir",
    "listdir",
    "open_file",
    "read_bytes",
    "write_bytes",
    "file_size",
    "tree_size",
    "remove_tree",
    "remove_file",
    "basename",
    "islink",
    "FileSlice",
    "member_path",
    "open_member",
    "read_member",
    "open_regular",
]


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on this machine's file system: where renames are atomic, files are
    fsync-ed, run directories are locked and keep a symlink. An object store has none of these."""
    return not is_url(path)


def normalize(path: str | os.PathLike) -> str:
    """An absolute local path, or the URL without a trailing slash."""
    p = os.fspath(path)
    if p.startswith("file://"):
        p = p[len("file://") :]
    return p.rstrip("/") if is_url(p) else os.path.abspath(p)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def islink(path: str) -> bool:
    """Whether ``path`` is a symlink (never on an object store, which has none)."""
    return not is_url(path) and os.path.islink(path)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def lexists(path: str) -> bool:
    """Whether anything is at ``path`` (locally: even a dangling symlink, a FIFO)."""
    if not is_url(path):
        return os.path.lexists(path)
    return exists(path)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    return fs.isfile(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under ``path``."""
    if not is_url(path):
        return os.listdir(path)
    fs, p = filesystem(path)
    return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)})


def open_file(path: str, mode: str = "rb") -> IO[bytes]:
    """A binary file object (``rb`` or ``wb``). Writing to an object store uploads on close."""
    if not is_url(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes, sync: bool = True) -> None:
    """Write a whole file, all or nothing: locally through a partial sibling and a rename
    (:func:`mfsdp_ckpt.storage.staging.write_file_atomic`), on an object store as one upload (atomic
    there), retried with backoff (:func:`mfsdp_ckpt.storage.remote.upload`)."""
    if is_url(path):
        upload(path, bytes(data))
        return
    write_file_atomic(path, data, sync=sync)


def file_size(f: Any) -> int:
    """Size of an open binary file, local or fsspec."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        size = getattr(f, "size", None)
        if isinstance(size, int):
            return size
        pos = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(pos)
        return end


def tree_size(path: str) -> int:
    """Bytes of every file under ``path``."""
    if not is_url(path):  # lstat: a dangling or looping symlink counts as itself, never raises
        return sum(_lsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    fs, p = filesystem(path)
    return int(fs.du(p, total=True))


def _lsize(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def remove_file(path: str) -> None:
    """Remove one file (nothing when there is none)."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p)


def remove_tree(path: str) -> None:
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


class FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream (torch.load reads
    a chunk's record straight into its tensor, with no intermediate copy)."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.pos)
        with memoryview(buffer) as view, view[:n] as part:  # released even if the read raises
            got = self.f.readinto(part)
        self.pos += got
        return got


# ---- files a checkpoint names ------------------------------------------------------------------
# A checkpoint names its own files: ``.metadata`` (each chunk's ``relative_path``), the manifest
# (each chunk's ``file``), a ``latest`` pointer. Whatever it names, readers open only regular files
# inside the checkpoint directory: no ``..``, no absolute names, no symlink leading out, and never a
# FIFO or a device (opened non-blocking and checked with ``fstat`` first, so nothing blocks).


def member_path(directory: str, name: object) -> str:
    """The path of the file ``name`` that a checkpoint in ``directory`` names (local path or fsspec
    URL), for display and opening; an :class:`OutsideCheckpointError` when ``name`` would leave the
    directory (see :func:`member_name_problem`). Symlinks are checked when opening."""
    problem = member_name_problem(name)
    if problem is not None:
        raise OutsideCheckpointError(directory, problem)
    assert isinstance(name, str)
    return join(directory, name)


def open_regular(path: str) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file; ``OSError`` otherwise. Local files are
    opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a FIFO or a device
    fails at once instead of blocking."""
    if is_url(path):
        fs, p = filesystem(path)
        if not fs.isfile(p):
            raise FileNotFoundError(errno.ENOENT, "No such file", path)
        return fs.open(p, "rb")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
            raise OSError(errno.EINVAL, f"not a regular file: {kind}", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_member(directory: str, name: object) -> IO[bytes]:
    """The regular file ``name`` inside checkpoint ``directory``, opened for reading.
    :class:`OutsideCheckpointError` when the name, or a symlink on the way, leads outside the
    directory; ``OSError`` when it is missing, unreadable or not a regular file."""
    path = member_path(directory, name)
    if is_url(path):
        return open_regular(path)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise OutsideCheckpointError(path, "a symlink leads outside the checkpoint directory")
    return open_regular(real)


def read_member(directory: str, name: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``name`` inside ``directory`` (see :func:`open_member`);
    with ``limit``, at most that many (a longer file raises ``OSError``)."""
    with open_member(directory, name) as f:
        data = f.read() if limit is None else read_bounded(f, limit)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"longer than {limit} bytes", join(directory, name))
    return data


_READ_PIECE = 1 << 20


def read_bounded(f: IO[bytes], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the open file ``f`` (one more than ``limit`` tells the caller
    the file is longer), read in pieces of 1 MiB: ``f.read(limit + 1)`` would reserve the whole
    bound up front (a 1 GiB manifest bound: 1 GiB of address space for a file of a few KB, which
    fails under ``ulimit -v`` or a container's memory cap)."""
    pieces, total = [], 0
    while total <= limit:
        piece = f.read(min(_READ_PIECE, limit + 1 - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)
