"""Paths for the checkpoint readers and offline writers: a local path or an fsspec URL
(``s3://bucket/prefix``, ``memory://…``, …).

Local paths go through ``os`` (so that ``fsync`` and ``rename`` keep their meaning); URLs through
fsspec, configured the usual fsspec way (e.g. ``FSSPEC_S3_ENDPOINT_URL`` for an S3-compatible
server). Object stores have no directories and no rename: there a checkpoint is committed by
writing ``mfsdp.json`` last, and readers refuse a prefix without it.
"""

from __future__ import annotations

import io
import os
import posixpath
import shutil
from typing import IO, Any

from .staging import write_file_atomic

__all__ = ["is_url", "join", "dirname", "normalize", "exists", "isfile", "isdir", "listdir", "open_file", "read_bytes",
           "write_bytes", "file_size", "tree_size", "remove_tree", "FileSlice"]


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL other than ``file://``."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def _fs(url: str) -> tuple[Any, str]:
    """The filesystem and its path for ``url``. fsspec shares one instance per configuration and
    caches listings in it; another process may have changed the store since (a checkpoint being
    committed or removed), so the listing cache is dropped before every use."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    fs.invalidate_cache()
    return fs, path


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


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    return fs.exists(p)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = _fs(path)
    return fs.isfile(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fs(path)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under ``path``."""
    if not is_url(path):
        return os.listdir(path)
    fs, p = _fs(path)
    return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)})


def open_file(path: str, mode: str = "rb") -> IO[bytes]:
    """A binary file object (``rb`` or ``wb``). Writing to an object store uploads on close."""
    if not is_url(path):
        return open(path, mode)
    fs, p = _fs(path)
    return fs.open(p, mode)


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes, sync: bool = True) -> None:
    """Write a whole file, all or nothing: locally through a partial sibling and a rename
    (:func:`mfsdp_ckpt.staging.write_file_atomic`), on an object store as one upload (atomic
    there)."""
    if is_url(path):
        with open_file(path, "wb") as f:
            f.write(data)
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
    if not is_url(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    fs, p = _fs(path)
    return int(fs.du(p, total=True))


def remove_tree(path: str) -> None:
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = _fs(path)
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
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got
