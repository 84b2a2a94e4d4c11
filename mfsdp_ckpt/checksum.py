"""crc32c: the checksum of every stored chunk, of ``.metadata`` and of the manifest itself.

Computed by the ``crc32c`` package, which uses the CPU's crc32 instruction and releases the GIL
on large buffers, so a load's reader threads verify chunks in parallel. Measured on the
development VM: 0.09 s per GB on one thread, 0.04 s on two, against 0.17 s (one or two threads)
for ``google-crc32c``, which holds the GIL. The values are the same (the tests check ours against
``google-crc32c``)."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: Any) -> int:
    """The crc32c (Castagnoli) of ``data``: bytes or any contiguous buffer (a numpy array, a
    memoryview)."""
    return _crc32c.crc32c(data)
