"""crc32c: the checksum of every stored chunk (:func:`payload_crc32c`, recorded in the manifest
under the chunk's :func:`chunk_id`), of ``.metadata`` and of the manifest itself.

Computed by the ``crc32c`` package, which uses the CPU's crc32 instruction and releases the GIL
on large buffers, so a load's reader threads verify chunks in parallel. Measured on the
development VM: 0.09 s per GB on one thread, 0.04 s on two, against 0.17 s (one or two threads)
for ``google-crc32c``, which holds the GIL. The values are the same (the tests check ours against
``google-crc32c``)."""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Any

import crc32c as _crc32c
import numpy

if TYPE_CHECKING:  # types only: a manifest's readers (the launcher's pre-flight) import no torch (~1.7 s)
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["crc32c", "crc32c_combine", "payload_crc32c", "chunk_id"]


def crc32c(data: Any) -> int:
    """The crc32c (Castagnoli) of ``data``: bytes or any contiguous buffer (a numpy array, a
    memoryview)."""
    return _crc32c.crc32c(data)


def payload_crc32c(data: torch.Tensor | io.BytesIO | bytes | memoryview) -> int:
    """crc32c of a chunk's payload: a tensor's bytes (row-major) or a serialized object's bytes."""
    if isinstance(data, io.BytesIO):
        data = data.getbuffer()
    if isinstance(data, memoryview):  # a uint8 view of any memoryview format
        data = numpy.frombuffer(data, dtype=numpy.uint8)
    if isinstance(data, (bytes, bytearray, numpy.ndarray)):
        return crc32c(data)
    return _tensor_crc32c(data)


def _tensor_crc32c(tensor: torch.Tensor) -> int:
    """crc32c of a tensor's bytes, row-major (torch is imported by whoever holds a tensor)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return crc32c(b"")
    return crc32c(flat.view(torch.uint8).numpy())


def chunk_id(index: MetadataIndex) -> str:
    """A key for one chunk: ``fqn`` or ``fqn@o0,o1,…`` (used by the manifest)."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


_POLY = 0x82F63B78  # crc32c's polynomial, bit-reversed (the CRC is computed least significant bit first)


def _mult_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo crc32c's polynomial, both (bit-reversed) polynomials over GF(2)."""
    m, p = 1 << 31, 0
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x_to_2_to_the(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    p = 1 << 30  # x^1
    for _ in range(k):
        p = _mult_mod_p(p, p)
    return p


_X2N = tuple(_x_to_2_to_the(k) for k in range(64))


@functools.lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending ``nbytes`` bytes does to a crc."""
    p, k = 1 << 31, 3  # x^0; bit 0 of nbytes is x^(2^3) = x^8
    while nbytes:
        if nbytes & 1:
            p = _mult_mod_p(_X2N[k], p)
        nbytes >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, nbytes_b: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``: pieces of one chunk
    are checked as they arrive, by several threads and out of order, while each piece is still in
    the CPU's cache (zlib's ``crc32_combine``; neither crc32c package offers it)."""
    if nbytes_b == 0:
        return crc_a
    return _mult_mod_p(_shift_operator(nbytes_b), crc_a) ^ crc_b
