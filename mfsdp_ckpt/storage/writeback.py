"""Starting the write-back of a file's bytes early, so that its final ``fsync`` waits for little.

A writer that fsyncs its file once at the end (before the rename that commits it) otherwise
leaves every byte dirty in the page cache until then, and the ``fsync`` waits for all of them:
the disk sits idle while the data is produced, then the writer sits idle while the disk works.
:func:`start_writeback` asks Linux to start writing a range that is complete
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it queues the I/O and returns), so the disk works
while the writer goes on. It changes nothing about durability: the ``fsync`` before the commit
is still what makes the file durable. Elsewhere, or if the call is unavailable, it does nothing.

A large write is started in slices of :data:`SLICE_BYTES` as it is made, not once at its end:
otherwise a 250 MiB tensor sits dirty in the page cache until all of it is written, and the disk
waits. :class:`WritebackStream` does this for a file object (``torch.save`` hands a tensor's bytes
over in one write); the safetensors writer slices its tensors by rows. Measured on the
development VM (2 CPUs; alternating runs, medians): HF export of 2.33 GB with 2 workers 1.7 s
against 2.6 s with one start per tensor, and 2.4 s with none; HF import 2.6 s against 3.4 s;
offline reshard (2.06 GiB, 4 to 3 ranks, 2 workers) 8.8-9.6 s against 9.3-10.6 s. ``mfsdp_ckpt.save``
does not use it: its one writer thread per rank measured slower with it (1.90 s against
1.43 s for 2 GB on 2 ranks; likely because a start can wait for the disk's queue while the
thread has more to copy): writing everything to the page cache first and fsyncing once was faster.
"""

from __future__ import annotations

import ctypes
import io
import sys
from typing import IO, Any

__all__ = ["SLICE_BYTES", "WritebackStream", "start_writeback"]

#: a large write is handed to the disk in slices of this many bytes (see the module's docstring)
SLICE_BYTES = 16 << 20

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the process's own symbols (libc is loaded): ctypes.util.find_library("c") would run
        # `ldconfig -p` in a subprocess at import, slow on a loaded machine
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
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


class WritebackStream:
    """A local binary file object whose writes of at least :data:`SLICE_BYTES` are made slice by
    slice, each slice's write-back started as soon as it is written. Everything else (``tell``,
    ``fileno``, ``flush``, ``close``, small writes) is the wrapped file's. A file without a
    descriptor (an object store's) or a system without ``sync_file_range`` is written as is."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        try:
            self._fd = f.fileno() if _SYNC is not None else -1
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._fd = -1

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self._fd < 0 or view.nbytes < SLICE_BYTES or not view.c_contiguous:
            return self._f.write(data)
        view = view.cast("B")
        self._f.flush()  # bytes buffered before this write reach the file first
        start = self._f.tell()
        for done in range(0, len(view), SLICE_BYTES):
            piece = view[done : done + SLICE_BYTES]
            written = 0
            while written < len(piece):  # an unbuffered file may take part of it
                written += self._f.write(piece[written:])
            self._f.flush()
            start_writeback(self._fd, start + done, len(piece))
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
