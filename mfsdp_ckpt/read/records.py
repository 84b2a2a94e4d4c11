"""Where a tensor's raw bytes sit inside a stored DCP chunk (a ``torch.save`` zip archive).

Reading those bytes straight into their destination skips ``torch.load``'s allocation and copy;
the chunk's crc32c is still checked on the bytes read. Only plain records qualify: stored
(uncompressed), little-endian, one storage whose size is exactly the chunk's, of the expected
dtype. Anything else returns None and the caller falls back to ``torch.load(weights_only=True)``;
so do fp8 and e8m0 records, which torch pickles without a legacy storage class
(:mod:`mfsdp_core.dtypes`).
"""

from __future__ import annotations

import contextlib
import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Iterator

import torch

from mfsdp_ckpt.storage.fs import FileSlice
from mfsdp_core.dtypes import storage_name

__all__ = ["RawTensorData", "locate_raw_tensor", "without_zip_crc"]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes
_END_RECORD = struct.Struct("<4s4H2LH")  # end of central directory record, 22 bytes
_CENTRAL_HEADER = struct.Struct("<4s6H3L5H2L")  # central directory file header, 46 bytes
_MAX_CENTRAL_BYTES = 1 << 16  # a torch.save record's directory is a few hundred bytes


@dataclass(frozen=True)
class _Member:
    """What :func:`locate_raw_tensor` reads of a zip member (named as ``zipfile.ZipInfo`` does)."""

    filename: str
    header_offset: int
    compress_type: int
    file_size: int


def _plain_directory(f: io.BufferedReader, record_offset: int, length: int) -> list[_Member] | None:
    """The members of the zip record, parsed directly when it has the shape ``torch.save`` gives
    a record under 4 GiB (no archive comment, no zip64 values in the end record or the entries);
    None for anything else, which ``zipfile`` then parses. Building a ``zipfile.ZipFile`` per
    record cost a small load (86 records) about 4 of its 18 ms. Every value is bounds-checked,
    and the tensor bytes found are still checked against their crc32c."""
    if length < _END_RECORD.size:
        return None
    f.seek(record_offset + length - _END_RECORD.size)
    end = f.read(_END_RECORD.size)
    if len(end) != _END_RECORD.size:
        return None
    signature, disk, cd_disk, on_disk, entries, cd_size, cd_offset, comment = _END_RECORD.unpack(end)
    if (
        signature != b"PK\x05\x06"
        or comment
        or disk
        or cd_disk
        or on_disk != entries
        or entries in (0, 0xFFFF)
        or cd_size > _MAX_CENTRAL_BYTES
        or cd_offset + cd_size > length - _END_RECORD.size
    ):
        return None
    f.seek(record_offset + cd_offset)
    directory = f.read(cd_size)
    if len(directory) != cd_size:
        return None
    members, at = [], 0
    for _ in range(entries):
        if at + _CENTRAL_HEADER.size > cd_size:
            return None
        fields = _CENTRAL_HEADER.unpack_from(directory, at)
        if fields[0] != b"PK\x01\x02":
            return None
        compress_type, file_size, name_len, extra_len, comment_len, header_offset = (
            fields[4],
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        if 0xFFFFFFFF in (fields[8], file_size, header_offset) or header_offset >= length:
            return None
        name_at = at + _CENTRAL_HEADER.size
        at = name_at + name_len + extra_len + comment_len
        if at > cd_size:
            return None
        try:
            name = directory[name_at : name_at + name_len].decode("utf-8")
        except UnicodeDecodeError:
            return None
        members.append(_Member(name, header_offset, compress_type, file_size))
    return members


@dataclass(frozen=True)
class RawTensorData:
    offset: int  # absolute offset of the first data byte in the file
    nbytes: int


def _member_start(f: io.BufferedReader, record_offset: int, entry: zipfile.ZipInfo | _Member) -> int | None:
    """Offset (within the record) of ``entry``'s first data byte, from its local file header."""
    f.seek(record_offset + entry.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != b"PK\x03\x04":
        return None
    return entry.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]


def _member_bytes(
    f: io.BufferedReader, record_offset: int, length: int, entry: zipfile.ZipInfo | _Member
) -> bytes | None:
    """A small stored member's bytes, read without the zip CRC check (records may skip the CRC)."""
    start = _member_start(f, record_offset, entry)
    if start is None or entry.compress_type != zipfile.ZIP_STORED or start + entry.file_size > length:
        return None
    f.seek(record_offset + start)
    data = f.read(entry.file_size)
    return data if len(data) == entry.file_size else None


def locate_raw_tensor(
    f: io.BufferedReader, offset: int, length: int, dtype: torch.dtype, numel: int
) -> RawTensorData | None:
    """The raw data of the record ``[offset, offset + length)`` of ``f``, if it is a plain record
    of ``numel`` elements of ``dtype`` (see module docstring); else None."""

    storage = storage_name(dtype)  # None: torch pickles an UntypedStorage and the dtype (fp8, e8m0)
    if storage is None:
        return None
    name = storage.encode()
    try:
        infos = _plain_directory(f, offset, length)
        if infos is None:
            infos = zipfile.ZipFile(FileSlice(f, offset, length)).infolist()
        data = [i for i in infos if "/data/" in i.filename and not i.filename.endswith(".pkl")]
        pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(data) != 1 or len(pkl) != 1 or len(order) != 1:
            return None
        entry = data[0]
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != numel * dtype.itemsize:
            return None
        if _member_bytes(f, offset, length, order[0]) != b"little":
            return None
        pickled = _member_bytes(f, offset, length, pkl[0])
        if pickled is None or name not in pickled:
            return None
        start = _member_start(f, offset, entry)
        if start is None or start + entry.file_size > length:
            return None
        return RawTensorData(offset + start, entry.file_size)
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, struct.error):
        return None


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """``torch.save`` records written inside skip the zip format's per-member CRC-32: every
    chunk's crc32c is already in the manifest and checked on every read, and torch's CRC-32 halves
    the write speed. ``torch.load`` (so DCP and every stock PyTorch reader) does not check it; a
    generic zip tool's integrity test would flag the records."""
    from torch.utils.serialization import config

    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = saved
