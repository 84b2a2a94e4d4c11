"""``CheckpointReader.read_flat`` of ranges that cut through large chunks: the wanted part of each
such chunk is read straight into the output (``direct_read.direct_part``), the rest of its bytes
only for the checksum, with the same result and the same refusals as reading the chunk whole."""

from __future__ import annotations

import os

import pytest
import torch

from mfsdp_ckpt import CorruptCheckpointError
from mfsdp_ckpt.read import reader as reader_module
from mfsdp_ckpt.read.chunks import chunk_location
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.write.builder import CheckpointBuilder

ROWS = (700, 500, 336)  # 1.37 MiB (above the coalescing size: read in part), 0.98 and 0.66 MiB (whole)
COLS = 512


def _build(path: str) -> torch.Tensor:
    t = torch.randn(sum(ROWS), COLS, generator=torch.Generator().manual_seed(3))
    with CheckpointBuilder(path, {}) as builder:
        at = 0
        for k, rows in enumerate(ROWS):
            builder.add_chunk("model.w", t[at : at + rows], (at, 0), t.shape, file=k % 2)
            at += rows
        builder.commit()
    return t


def _counting_direct_reads(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = reader_module.read_into_place

    def counted(files, chunks, *, threads):
        calls.append(len(chunks))
        return real(files, chunks, threads=threads)

    monkeypatch.setattr(reader_module, "read_into_place", counted)
    return calls


def test_ranges_through_large_chunks_equal_the_whole_tensors_slices(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    t = _build(path).reshape(-1)
    calls = _counting_direct_reads(monkeypatch)
    n, first = t.numel(), ROWS[0] * COLS
    ranges = [(0, 0), (0, n), (1, n - 1), (5, 6), (first - 1, first + 1), (17, first + 300 * COLS + 3), (first, n)]
    ranges += [(a, b) for a in range(0, n, 97_531) for b in range(a, n + 1, 211_007)]
    with CheckpointReader(path) as reader:
        for a, b in ranges:
            assert torch.equal(reader.read_flat("model.w", a, b), t[a:b]), (a, b)
            out = torch.full((b - a,), float("nan"))
            assert reader.read_flat("model.w", a, b, out=out) is out
            assert torch.equal(out, t[a:b]), (a, b)
    assert calls and all(c == 1 for c in calls)  # only the large first chunk is read in part


def test_a_bad_byte_outside_the_wanted_part_is_still_refused(tmp_path, monkeypatch):
    """The part of the chunk nobody asked for is read too, for the chunk's crc32c: damage there
    fails the read, naming the chunk, as a whole-chunk read would."""
    path = str(tmp_path / "ckpt")
    t = _build(path).reshape(-1)
    calls = _counting_direct_reads(monkeypatch)
    with CheckpointReader(path) as reader:
        index, info = next(c for c in reader._chunks_by_key["model.w"] if tuple(c[0].offset) == (0, 0))
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        raw = locate_raw_tensor(f, info.offset, info.length, torch.float32, ROWS[0] * COLS)
        f.seek(raw.offset + raw.nbytes - 8)  # the chunk's last element, far from the range read
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with CheckpointReader(path) as reader:
        with pytest.raises(CorruptCheckpointError) as e:
            reader.read_flat("model.w", 10, 1000)  # far from the damaged bytes
        assert str(e.value) == f"{chunk_location(os.path.join(path, info.relative_path), index)}: checksum mismatch"
        assert torch.equal(reader.read_flat("model.w", ROWS[0] * COLS, t.numel()), t[ROWS[0] * COLS :])
    assert calls == [1]
