"""Write-back started slice by slice: the bytes written never change, and every byte of a large
write is handed to the disk in slices as it is written (mfsdp_ckpt/storage/writeback.py, the HF writer's
row slices, the chunk writer of import / reshard)."""

from __future__ import annotations

import io
import os

import pytest
import torch
from safetensors import safe_open

import mfsdp_ckpt.hf.files as hf_files
import mfsdp_ckpt.storage.writeback as writeback
from mfsdp_ckpt.hf.files import SafetensorsWriter, _row_slices
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.storage.writeback import WritebackStream
from mfsdp_ckpt.write.builder import CheckpointBuilder

SLICE = 4096


@pytest.fixture
def started(monkeypatch) -> list[tuple[int, int, int]]:
    """Every ``sync_file_range`` call as (fd, offset, nbytes), with slices of 4 KiB (the calls are
    recorded instead of made, so the test runs the same on any system)."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writeback, "_SYNC", lambda fd, offset, nbytes, flags: calls.append((fd, offset, nbytes)))
    monkeypatch.setattr(writeback, "SLICE_BYTES", SLICE)
    return calls


def _covers(calls: list[tuple[int, int, int]], start: int, nbytes: int) -> bool:
    """The calls are consecutive slices of at most SLICE bytes covering [start, start + nbytes)."""
    at = start
    for _, offset, n in calls:
        if offset != at or not 0 < n <= SLICE:
            return False
        at += n
    return at == start + nbytes


def test_a_large_write_goes_out_in_started_slices_after_what_was_buffered(tmp_path, started):
    path = tmp_path / "f"
    head, big, tail = b"abc", os.urandom(3 * SLICE + 123), b"xyz"
    with open(path, "wb") as f:
        stream = WritebackStream(f)
        stream.write(head)  # buffered: must reach the file before the large write
        assert stream.write(big) == len(big)
        stream.write(tail)
        fd = f.fileno()
    assert path.read_bytes() == head + big + tail
    assert {c[0] for c in started} == {fd}
    assert _covers(started, len(head), len(big))
    assert len(started) == 4


def test_an_unbuffered_file_that_takes_part_of_a_write_gets_all_of_it(tmp_path, started):
    class Short(io.FileIO):
        def write(self, b):  # at most 1000 bytes per call, like a short write
            return super().write(memoryview(b)[:1000])

    data = os.urandom(2 * SLICE + 10)
    with Short(tmp_path / "f", "wb") as f:
        assert WritebackStream(f).write(data) == len(data)
    assert (tmp_path / "f").read_bytes() == data
    assert _covers(started, 0, len(data))


def test_small_and_descriptorless_writes_pass_through(tmp_path, started):
    with open(tmp_path / "f", "wb") as f:
        WritebackStream(f).write(b"x" * (SLICE - 1))
    assert (tmp_path / "f").read_bytes() == b"x" * (SLICE - 1)
    memory = io.BytesIO()
    WritebackStream(memory).write(b"y" * (5 * SLICE))  # no descriptor (like an object store's file)
    assert memory.getvalue() == b"y" * (5 * SLICE) and started == []


def test_torch_save_through_the_stream_writes_the_same_bytes(tmp_path, started):
    t = torch.randn(50, 300)
    with open(tmp_path / "plain", "wb") as f:
        torch.save(t, f)
    with open(tmp_path / "sliced", "wb") as f:
        torch.save(t, WritebackStream(f))
    assert (tmp_path / "sliced").read_bytes() == (tmp_path / "plain").read_bytes()
    assert len(started) >= t.numel() * 4 // SLICE


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(37, 100),  # rows that do not divide the slice
        lambda: torch.randn(40, 100)[:, 10:70],  # a strided view (a piece of a fused tensor)
        lambda: torch.randn(9000),  # one dimension
        lambda: torch.randn(1, 5000),  # one row
        lambda: torch.randn(5000, 0),  # no bytes
    ],
)
def test_row_slices_hold_the_tensors_bytes_in_order(monkeypatch, make):
    monkeypatch.setattr(hf_files, "SLICE_BYTES", SLICE)
    t = make()
    slices = _row_slices(t)
    nbytes = t.numel() * t.element_size()
    assert torch.equal(torch.cat([p.reshape(-1) for _, p in slices]), t.reshape(-1))
    at = 0
    for start, piece in slices:
        assert start == at
        at += piece.numel() * piece.element_size()
    assert at == nbytes
    if t.dim() > 0 and t.shape[0] > 1 and nbytes > SLICE:
        assert len(slices) > 1 and all(p.numel() * p.element_size() <= max(SLICE, t[0].numel() * 4) for _, p in slices)


def test_safetensors_writer_slices_and_writes_the_same_tensors(tmp_path, monkeypatch):
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(hf_files, "SLICE_BYTES", SLICE)
    monkeypatch.setattr(hf_files, "start_writeback", lambda fd, offset, nbytes: calls.append((offset, nbytes)))
    fused = torch.randn(64, 48)
    tensors = {"a": torch.randn(37, 100), "b": fused[16:48], "c": fused[:, 8:40], "d": torch.randn(3)}
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    path = str(tmp_path / "model.safetensors")
    writer = SafetensorsWriter(path, entries, {"format": "pt"})
    for name in ("c", "a", "d", "b"):  # any order
        writer.write(name, tensors[name])
    writer.close()
    with safe_open(path, "pt") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name
    assert sum(n for _, n in calls) == sum(t.numel() * 4 for t in tensors.values())
    assert len(calls) > len(tensors)  # "a" (14,800 bytes) went out in 4 KiB slices


def test_chunk_writer_slices_and_the_checkpoint_reads_back_bitwise(tmp_path, started):
    tensors = {"model.w": torch.randn(70, 90), "model.b": torch.randn(7), "optim.m": torch.randn(5, 2000)}
    path = str(tmp_path / "ckpt")
    with CheckpointBuilder(path, {}) as builder:
        for key, t in tensors.items():
            builder.add_tensor(key, t)
        builder.commit()
    reader = CheckpointReader(path)
    try:
        for key, t in tensors.items():
            assert torch.equal(reader.read(key), t), key
    finally:
        reader.close()
    big = sum(1 for _, _, n in started if n == SLICE)
    assert big >= (70 * 90 * 4) // SLICE + (5 * 2000 * 4) // SLICE


def test_an_unsynced_builder_starts_no_write_back(tmp_path, started):
    with CheckpointBuilder(str(tmp_path / "ckpt"), {}, sync=False) as builder:
        builder.add_tensor("model.w", torch.randn(70, 90))
        builder.commit()
    assert started == []
