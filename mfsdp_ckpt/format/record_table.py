"""The record table at the end of each data file a ``save`` writes: where each chunk's record
sits in the file and its crc32c.

Per chunk, 28 bytes: an 8-byte hash of its chunk id (``key`` or ``key@o0,o1,…``, see
:func:`~mfsdp_ckpt.format.checksum.chunk_id`), the record's offset and length, and the crc32c of
its payload; then a 20-byte trailer: a magic string, the row count and the crc32c of the rows.
The index in ``mfsdp.json`` lists every file with its table's size and crc32c, so the table is
read with one ranged read and trusted only when it matches.

Why in the data file: the offsets and checksums of a save are one row per chunk, ranks × tensors
in all; kept beside the data each rank writes, the manifest stays O(tensors) and a reader reads
only the tables of the files it reads from. Stock DCP readers read records by the offsets in
``.metadata`` and never look past the last one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from mfsdp_ckpt.format.checksum import crc32c

__all__ = ["Record", "DataFile", "MAGIC", "encode_table", "decode_table", "table_size", "table_crc", "chunk_hash"]

MAGIC = b"MFSDPRT1"
_ROW = struct.Struct("<QQQI")
_TRAILER = struct.Struct("<8sQI")


@dataclass(frozen=True)
class Record:
    """Where one chunk's record sits in its file, and the crc32c of its payload."""

    offset: int
    length: int
    crc32c: int


@dataclass(frozen=True)
class DataFile:
    """One data file of a save, as the index lists it: its name, the rank that wrote it, its
    size, and its record table's row count and crc32c."""

    name: str
    rank: int
    size: int
    rows: int
    table_crc32c: int

    def to_list(self) -> list[Any]:
        return [self.name, self.rank, self.size, self.rows, self.table_crc32c]

    @classmethod
    def from_list(cls, v: Any) -> "DataFile":
        return cls(*v)


def chunk_hash(cid: str) -> int:
    """The 64-bit hash a table files a chunk under (blake2b of its chunk id)."""
    return int.from_bytes(hashlib.blake2b(cid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def table_size(rows: int) -> int:
    """Bytes of a table of ``rows`` rows, trailer included."""
    return rows * _ROW.size + _TRAILER.size


def encode_table(rows: Iterable[tuple[str, Record]]) -> bytes:
    """The table of ``(chunk id, record)`` rows. ValueError when two chunk ids hash alike (two
    chunks a table could not tell apart; never seen, but refused rather than mixed up)."""
    body = bytearray()
    seen: set[int] = set()
    for cid, rec in rows:
        h = chunk_hash(cid)
        if h in seen:
            raise ValueError(f"chunk '{cid}': its hash collides with another chunk of the same file")
        seen.add(h)
        body += _ROW.pack(h, rec.offset, rec.length, rec.crc32c)
    return bytes(body) + _TRAILER.pack(MAGIC, len(seen), crc32c(bytes(body)))


def table_crc(table: bytes) -> int:
    """The crc32c a table's trailer carries (of its rows), what the index records."""
    return _TRAILER.unpack_from(table, len(table) - _TRAILER.size)[2]


def decode_table(data: bytes, rows: int, expected_crc: int) -> dict[int, Record]:
    """The rows of a table read from a file's end (``rows`` and ``expected_crc`` as the index
    lists them): chunk hash -> record. ValueError saying what is wrong."""
    if len(data) != table_size(rows):
        raise ValueError(f"record table is {len(data)} bytes, the index says {table_size(rows)}")
    magic, count, crc = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    body = memoryview(data)[: len(data) - _TRAILER.size]
    if magic != MAGIC or count != rows:
        raise ValueError("no record table at the end of the file (the file was changed after the save)")
    if crc != expected_crc or crc32c(body) != crc:
        raise ValueError("record table checksum mismatch (the file was changed after the save)")
    out: dict[int, Record] = {}
    for h, offset, length, c in _ROW.iter_unpack(body):
        out[h] = Record(offset, length, c)
    if len(out) != rows:
        raise ValueError("record table lists a chunk twice")
    return out
