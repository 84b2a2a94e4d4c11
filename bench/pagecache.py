"""Shared by the benchmarks: make the next read of a file come from the disk, not the page cache."""

from __future__ import annotations

import os


def drop_cache(path: str) -> None:
    """Evict a file or a directory tree from the page cache (its data is already on disk)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
