"""Positioned reads and writes of an open file (``os.preadv`` / ``os.pwritev``): each call names
its offset, so threads share one descriptor without a file position between them, and the kernel
copies with the GIL released. The one loop that resumes after a short transfer (issue 53): every
reader of bytes at an offset (checkpoint chunks, safetensors files, strided tensor views) uses it
and decides for itself what a file that ends early means."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

__all__ = ["IOV_MAX", "pread_into", "pwrite_from"]

#: the most buffers one vectored call takes (the platform's ``IOV_MAX``, at most 1024)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def pread_into(fd: int, buffers: Any, offset: int) -> int:
    """Fill ``buffers`` (one writable buffer: a ``bytearray``, a uint8 numpy array, a memoryview;
    or a list of memoryviews, filled in order) with the bytes at ``offset`` of the open file
    ``fd``, resuming after short reads: the bytes read, fewer than asked only where the file
    ends. An ``OSError`` propagates."""
    if isinstance(buffers, (list, tuple)):
        return _transfer(_preadv, fd, buffers, offset)
    with memoryview(buffers) as view:
        return _transfer(_preadv, fd, [view], offset)


def pwrite_from(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Write ``buffers`` in order at ``offset`` of the open file ``fd``, resuming after short
    writes: the bytes written (fewer only where a write wrote nothing)."""
    return _transfer(os.pwritev, fd, buffers, offset)


def _preadv(fd: int, views: list[memoryview], offset: int) -> int:
    """``os.preadv``, or ``os.pread`` of the first buffer and a copy where the platform has none."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, views, offset)
    data = os.pread(fd, len(views[0]), offset)
    views[0][: len(data)] = data
    return len(data)


def _transfer(
    call: Callable[[int, list[memoryview], int], int], fd: int, buffers: Sequence[memoryview], offset: int
) -> int:
    """Move the bytes of ``buffers`` with ``call(fd, batch, offset)``, at most :data:`IOV_MAX`
    buffers a call, resuming inside a buffer after a partial transfer; stops at a transfer of 0
    bytes (end of file). The bytes moved."""
    start = offset
    i, skip = 0, 0  # next buffer, bytes of it already done
    while i < len(buffers):
        batch = [buffers[i][skip:], *buffers[i + 1 : i + IOV_MAX]]
        n = call(fd, batch, offset)
        if n == 0:
            break
        offset += n
        n += skip
        while i < len(buffers) and n >= len(buffers[i]):
            n -= len(buffers[i])
            i += 1
        skip = n
    return offset - start
