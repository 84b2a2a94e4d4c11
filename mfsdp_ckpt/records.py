"""Where a tensor's raw bytes sit inside a stored DCP chunk (a ``torch.save`` zip archive).

Reading those bytes straight into their destination skips ``torch.load``'s allocation and copy;
the chunk's crc32c is still checked on the bytes read. Only plain records qualify: stored
(uncompressed), little-endian, one storage whose size is exactly the chunk's, of the expected
dtype. Anything else returns None and the caller falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass

import torch

__all__ = ["RawTensorData", "locate_raw_tensor"]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes


@dataclass(frozen=True)
class RawTensorData:
    offset: int  # absolute offset of the first data byte in the file
    nbytes: int


def _storage_name(dtype: torch.dtype) -> bytes:
    return {
        torch.float32: b"FloatStorage", torch.float64: b"DoubleStorage", torch.float16: b"HalfStorage",
        torch.bfloat16: b"BFloat16Storage", torch.int64: b"LongStorage", torch.int32: b"IntStorage",
        torch.int16: b"ShortStorage", torch.int8: b"CharStorage", torch.uint8: b"ByteStorage",
        torch.bool: b"BoolStorage",
    }.get(dtype, b"")


def locate_raw_tensor(f: io.BufferedReader, offset: int, length: int, dtype: torch.dtype, numel: int) -> RawTensorData | None:
    """The raw data of the record ``[offset, offset + length)`` of ``f``, if it is a plain record
    of ``numel`` elements of ``dtype`` (see module docstring); else None."""
    from .storage import FileSlice

    name = _storage_name(dtype)
    if not name:
        return None
    try:
        archive = zipfile.ZipFile(FileSlice(f, offset, length))
        infos = archive.infolist()
        data = [i for i in infos if "/data/" in i.filename and not i.filename.endswith(".pkl")]
        pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(data) != 1 or len(pkl) != 1 or len(order) != 1:
            return None
        entry = data[0]
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != numel * dtype.itemsize:
            return None
        if archive.read(order[0]) != b"little" or name not in archive.read(pkl[0]):
            return None
        f.seek(offset + entry.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            return None
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != b"PK\x03\x04":
            return None
        name_len, extra_len = fields[-2], fields[-1]
        start = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + entry.file_size > length:
            return None
        return RawTensorData(offset + start, entry.file_size)
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, struct.error):
        return None
