"""``mfsdp_ckpt.format.checksum.crc32c`` gives the values every checkpoint already holds: the Castagnoli
check value, and google-crc32c's results (the library earlier checkpoints were written with) on
buffers of odd sizes and alignments, as bytes, numpy arrays and memoryviews."""

from __future__ import annotations

import google_crc32c
import numpy
import pytest

from mfsdp_ckpt.format.checksum import crc32c, payload_crc32c


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
