"""crc32c: the checksum of every stored chunk (:func:`payload_crc32c`, recorded in the manifest
under the chunk's :func:`chunk_id`), of ``.metadata`` and of the manifest itself.

Computed by the ``crc32c`` package, which uses the CPU's crc32 instruction and releases the GIL
on large buffers, so a load's reader threads verify chunks in parallel. Measured on the
development VM: 0.09 s per GB on one thread, 0.04 s on two, against 0.17 s (one or two threads)
for ``google-crc32c``, which holds the GIL. The values are the same (the tests check ours against
``google-crc32c``)."""

from __future__ import annotations

import io
from typing import Any

import crc32c as _crc32c
import numpy
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["crc32c", "payload_crc32c", "chunk_id"]


def crc32c(data: Any) -> int:
    """The crc32c (Castagnoli) of ``data``: bytes or any contiguous buffer (a numpy array, a
    memoryview)."""
    return _crc32c.crc32c(data)


def payload_crc32c(data: torch.Tensor | io.BytesIO | bytes | memoryview) -> int:
    """crc32c of a chunk's payload: a tensor's bytes (row-major) or a serialized object's bytes."""
    if isinstance(data, torch.Tensor):
        flat = data.detach().contiguous().reshape(-1)
        if flat.numel() == 0:
            return crc32c(b"")
        return crc32c(flat.view(torch.uint8).numpy())
    if isinstance(data, io.BytesIO):
        data = data.getbuffer()
    if isinstance(data, memoryview):  # a uint8 view of any memoryview format
        data = numpy.frombuffer(data, dtype=numpy.uint8)
    return crc32c(data)


def chunk_id(index: MetadataIndex) -> str:
    """A key for one chunk: ``fqn`` or ``fqn@o0,o1,…`` (used by the manifest)."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"
