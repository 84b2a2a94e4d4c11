"""The one positioned-read loop (mfsdp_ckpt/storage/positioned.py): it resumes after short
transfers, stops at the end of the file, fills several buffers in order, and every reader of
bytes at an offset goes through it."""

from __future__ import annotations

import os

import numpy

from mfsdp_ckpt.storage import positioned
from mfsdp_ckpt.storage.positioned import pread_into, pwrite_from


def _file(tmp_path, data: bytes) -> int:
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return os.open(path, os.O_RDWR)


def test_short_reads_are_resumed_and_the_end_of_file_stops_them(tmp_path, monkeypatch):
    data = bytes(range(256)) * 4
    fd = _file(tmp_path, data)
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda f, views, off: real(f, [views[0][:3]], off))  # 3 bytes a call
    try:
        out = numpy.zeros(600, dtype=numpy.uint8)
        assert pread_into(fd, out, 100) == 600 and out.tobytes() == data[100:700]
        buf = bytearray(50)
        assert pread_into(fd, buf, len(data) - 20) == 20 and bytes(buf[:20]) == data[-20:]  # the file ends
        assert pread_into(fd, bytearray(0), 0) == 0
    finally:
        os.close(fd)


def test_several_buffers_are_filled_in_order_across_iov_max(tmp_path, monkeypatch):
    data = os.urandom(4000)
    fd = _file(tmp_path, data)
    monkeypatch.setattr(positioned, "IOV_MAX", 3)  # several calls, each resuming inside a buffer
    try:
        parts = [bytearray(n) for n in (7, 0, 1000, 13, 2000, 1)]
        views = [memoryview(p) for p in parts]
        assert pread_into(fd, views, 11) == 3021 and b"".join(parts) == data[11:3032]
        assert pwrite_from(fd, [memoryview(b"abc"), memoryview(b"de")], 1) == 5
        assert os.pread(fd, 6, 0) == data[:1] + b"abcde"
    finally:
        os.close(fd)


def test_no_reader_keeps_its_own_preadv_loop():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    found = []
    for top in ("mfsdp_ckpt", "cli"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                path = os.path.join(directory, name)
                if name.endswith(".py") and not path.endswith(os.path.join("storage", "positioned.py")):
                    text = open(path).read()
                    found += [os.path.relpath(path, root) for call in ("os.preadv(", "os.pread(") if call in text]
    assert not found, found
