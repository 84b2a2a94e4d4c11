"""Starting the write-back of a file's bytes early, so that its final ``fsync`` waits for little.

A writer that fsyncs its file once at the end (before the rename that commits it) otherwise
leaves every byte dirty in the page cache until then, and the ``fsync`` waits for all of them:
the disk sits idle while the data is produced, then the writer sits idle while the disk works.
:func:`start_writeback` asks Linux to start writing a range that is complete
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it queues the I/O and returns), so the disk works
while the writer goes on. It changes nothing about durability: the ``fsync`` before the commit
is still what makes the file durable. Elsewhere, or if the call is unavailable, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

__all__ = ["start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing bytes ``[offset, offset + nbytes)`` of the open file ``fd`` to disk, without
    waiting for them (a hint: failures are ignored; the final ``fsync`` reports real errors).
    The call releases the GIL."""
    if _SYNC is not None and nbytes > 0:
        _SYNC(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
