"""``mfsdp_ckpt.format.checksum.crc32c`` gives the values every checkpoint already holds: the Castagnoli
check value, and google-crc32c's results (the library earlier checkpoints were written with) on
buffers of odd sizes and alignments, as bytes, numpy arrays and memoryviews."""

from __future__ import annotations

import random

import google_crc32c
import numpy
import pytest

from mfsdp_ckpt.format.checksum import crc32c, crc32c_combine, payload_crc32c


def test_the_castagnoli_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


@pytest.mark.parametrize("size", [1, 7, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("start", [0, 1, 5])
def test_the_same_values_as_google_crc32c(size, start):
    data = numpy.random.default_rng(size + start).integers(0, 256, size + start, dtype=numpy.uint8)[start:]
    want = google_crc32c.value(data.tobytes())
    assert crc32c(data) == want
    assert crc32c(data.tobytes()) == want
    assert crc32c(memoryview(data)) == want
    assert payload_crc32c(memoryview(data.tobytes())) == want


def test_combine_is_the_crc_of_the_concatenation():
    rng = random.Random(3)
    lengths = [0, 1, 2, 3, 7, 8, 64, 1000, 4096, (1 << 16) + 5]
    for la in lengths:
        for lb in lengths:
            a, b = rng.randbytes(la), rng.randbytes(lb)
            assert crc32c_combine(crc32c(a), crc32c(b), lb) == crc32c(a + b), (la, lb)
    # many pieces joined left to right, as a chunk's blocks are
    pieces = [rng.randbytes(rng.randint(0, 3000)) for _ in range(40)]
    joined = 0
    for i, piece in enumerate(pieces):
        joined = crc32c(piece) if i == 0 else crc32c_combine(joined, crc32c(piece), len(piece))
    assert joined == crc32c(b"".join(pieces))
