"""``records.locate_raw_tensor``: the raw bytes of a plain ``torch.save`` chunk record are found
(with or without the zip CRC), and anything else is declined so the caller falls back to
``torch.load``."""

from __future__ import annotations

import io

import pytest
import torch

from mfsdp_ckpt.read.records import locate_raw_tensor, without_zip_crc


def _record(tensor: torch.Tensor, crc: bool, prefix: bytes = b"x" * 77) -> tuple[io.BytesIO, int, int]:
    buf = io.BytesIO()
    buf.write(prefix)
    if crc:
        torch.save(tensor, buf)
    else:
        with without_zip_crc():
            torch.save(tensor, buf)
    return buf, len(prefix), buf.tell() - len(prefix)


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_plain_record_bytes_are_found(crc, dtype):
    t = (torch.randn(13, 7) * 10).to(dtype)
    buf, offset, length = _record(t, crc)
    raw = locate_raw_tensor(buf, offset, length, dtype, t.numel())
    assert raw is not None and raw.nbytes == t.numel() * t.element_size()
    data = buf.getvalue()[raw.offset : raw.offset + raw.nbytes]
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(13, 7), t)
    if not crc:
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()[offset:]), weights_only=True), t)  # stock reader


def test_anything_else_is_declined():
    t = torch.randn(10)
    buf, offset, length = _record(t, crc=False)
    assert locate_raw_tensor(buf, offset, length, torch.float64, t.numel()) is None  # other dtype
    assert locate_raw_tensor(buf, offset, length, torch.int32, t.numel()) is None  # same width, other dtype
    assert locate_raw_tensor(buf, offset, length, torch.float32, t.numel() + 1) is None  # other size
    view_buf, o, n = _record(torch.randn(100)[10:20], crc=True)  # a view: the whole storage is saved
    assert locate_raw_tensor(view_buf, o, n, torch.float32, 10) is None
    garbage = io.BytesIO(b"\0" * 500)
    assert locate_raw_tensor(garbage, 0, 500, torch.float32, 10) is None
    assert locate_raw_tensor(buf, offset, length - 30, torch.float32, t.numel()) is None  # truncated record


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu], ids=str)
def test_fp8_records_fall_back_to_torch_load_bit_exact(tmp_path, dtype):
    from mfsdp_ckpt.read.reader import CheckpointReader
    from mfsdp_ckpt.tools.inspect import verify_checkpoint
    from mfsdp_ckpt.write.builder import CheckpointBuilder

    t = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    buf, offset, length = _record(t, crc=False)
    assert locate_raw_tensor(buf, offset, length, dtype, t.numel()) is None  # no legacy storage class to find
    path = str(tmp_path / "fp8")
    with CheckpointBuilder(path, {}) as builder:
        builder.add_chunk("mx.w", t[:5], (0, 0), t.shape)
        builder.add_chunk("mx.w", t[5:], (5, 0), t.shape, file=1)
        builder.commit()
    with CheckpointReader(path) as reader:
        back = reader.read("mx.w")
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(reader.read_flat("mx.w", 70, 90).view(torch.uint8), t.reshape(-1)[70:90].view(torch.uint8))
    assert verify_checkpoint(path) == []


def _with_comment(record: bytes, comment: bytes) -> bytes:
    """The record with a zip archive comment: the end record's last field and the bytes after it."""
    return record[:-2] + len(comment).to_bytes(2, "little") + comment


@pytest.mark.parametrize("shape", [(13, 7), (0,), (5,)])
def test_the_directly_parsed_directory_and_zipfile_agree(monkeypatch, shape):
    """The hand parser of torch.save's directory (the fast path) finds the same bytes as
    ``zipfile``; a record it does not take on (an archive comment) goes to ``zipfile`` and is
    still found; with the hand parser made to decline everything, the results are the same."""
    from mfsdp_ckpt.read import records

    t = torch.randn(shape)
    buf, offset, length = _record(t, crc=False)
    fast = locate_raw_tensor(buf, offset, length, t.dtype, t.numel())
    assert records._plain_directory(buf, offset, length) is not None
    commented = io.BytesIO(_with_comment(buf.getvalue(), b"hello"))
    assert records._plain_directory(commented, offset, length + 5) is None
    assert locate_raw_tensor(commented, offset, length + 5, t.dtype, t.numel()) == fast
    monkeypatch.setattr(records, "_plain_directory", lambda *a: None)
    assert locate_raw_tensor(buf, offset, length, t.dtype, t.numel()) == fast


@pytest.mark.parametrize("cut", [1, 22, 60, 200])
def test_a_damaged_directory_is_declined_or_left_to_zipfile(cut):
    """A record whose tail (end record, directory) is cut or overwritten is never located at a
    wrong place: either declined or found where zipfile finds it."""
    t = torch.randn(9, 3)
    buf, offset, length = _record(t, crc=False)
    data = bytearray(buf.getvalue())
    data[-cut] ^= 0xFF
    damaged = io.BytesIO(bytes(data))
    got = locate_raw_tensor(damaged, offset, length, t.dtype, t.numel())
    assert got is None or got == locate_raw_tensor(buf, offset, length, t.dtype, t.numel())
