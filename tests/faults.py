"""Injected faults shared by the tests: a file that fills up."""

from __future__ import annotations

import errno
import os


class FullDisk:
    """A binary file whose writes fail with ENOSPC once ``room`` bytes went through."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)
