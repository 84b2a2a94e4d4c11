"""Reading stored chunks, in one place for every reader (``load``'s DCP reader, the streaming
reader of the offline tools, ``verify``).

A chunk is one ``torch.save`` record (or one serialized object) at a byte range of a data file.
:class:`ChunkFiles` opens a checkpoint's data files once each (local or fsspec) and reads chunks
through :func:`read_chunk`, which checks that a chunk is complete, readable and matches the
manifest's crc32c. :func:`coverage_faults` checks from metadata alone that a tensor's chunks
cover it exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import IO, Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from . import fs
from .errors import CorruptCheckpointError
from .fs import FileSlice
from .planner import chunk_id, payload_crc32c
from .records import locate_raw_tensor

__all__ = [
    "FileSlice", "ChunkFault", "ChunkFiles", "Fault", "chunk_shapes", "chunk_location", "read_chunk",
    "coverage_faults",
]


class ChunkFault(Exception):
    """What is wrong with one chunk (the caller adds the file and key)."""


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a checkpoint: in ``file`` (None: the metadata), at ``key``'s chunk at
    ``offset`` (None: the key as a whole)."""

    file: str | None
    key: str
    offset: tuple[int, ...] | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        at = f" at {list(self.offset)}" if self.offset is not None else ""
        return f"{where}{self.key}{at}: {self.message}"


def chunk_shapes(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor chunk's dtype and sizes, by its storage index (what :func:`read_chunk` expects)."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                out[MetadataIndex(key, torch.Size(chunk.offsets))] = (md.properties.dtype, tuple(chunk.sizes))
    return out


def chunk_location(path: str, index: MetadataIndex) -> str:
    """``<file>: key '<fqn>' chunk at [o0, o1]``, how every error about one chunk starts."""
    return f"{path}: key '{index.fqn}'" + (f" chunk at {list(index.offset)}" if index.offset is not None else "")


def read_chunk(f: IO[bytes], info: Any, index: MetadataIndex, manifest_chunks: dict[str, Any] | None,
               expect: tuple[torch.dtype, Sequence[int]] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor | bytes:
    """One chunk's payload: a tensor, or the bytes of a serialized object (``index.offset`` is
    None). Checks that it is complete, readable, listed in the manifest and matches its crc32c
    (when there is a manifest); raises :class:`ChunkFault` otherwise.

    With ``expect`` (the chunk's dtype and sizes from the metadata) a plain record's bytes are read
    straight into a new tensor instead of going through ``torch.load``; with ``out`` (a contiguous
    tensor of the chunk's dtype and element count) straight into ``out``, which is returned."""
    if info.transform_descriptors:
        raise ChunkFault(f"stream transforms {info.transform_descriptors} are not supported")
    size = fs.file_size(f)
    if size < info.offset + info.length:
        raise ChunkFault(f"truncated (needs bytes {info.offset}..{info.offset + info.length}, the file has {size})")
    expected = None
    if manifest_chunks is not None:
        entry = manifest_chunks.get(chunk_id(index))
        if entry is None:
            raise ChunkFault("not listed in the manifest")
        expected = entry["crc32c"]
    if out is not None:
        expect = (out.dtype, out.shape)
    raw = None
    if index.offset is not None and expect is not None:
        raw = locate_raw_tensor(f, info.offset, info.length, expect[0], math.prod(expect[1]))
    if index.offset is None:
        f.seek(info.offset)
        payload: torch.Tensor | bytes = f.read(info.length)
    elif raw is not None:
        assert expect is not None
        payload = out if out is not None else torch.empty(tuple(expect[1]), dtype=expect[0])
        f.seek(raw.offset)
        if payload.numel() and f.readinto(payload.view(-1).view(torch.uint8).numpy()) != raw.nbytes:
            raise ChunkFault("truncated tensor data")
    else:
        try:
            payload = torch.load(FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except Exception as e:
            first_line = (str(e).splitlines() or [""])[0]
            raise ChunkFault(f"unreadable chunk ({type(e).__name__}: {first_line})") from None
        if not isinstance(payload, torch.Tensor):
            raise ChunkFault("chunk does not hold a tensor")
        if out is not None:
            if payload.dtype != out.dtype or payload.numel() != out.numel():
                raise ChunkFault(f"holds {payload.dtype} {tuple(payload.shape)}, which does not fit its metadata")
            payload = out.copy_(payload.reshape(out.shape))
    if expected is not None and payload_crc32c(payload) != expected:
        raise ChunkFault("checksum mismatch")
    return payload


class ChunkFiles:
    """The data files of one checkpoint directory (a local path or an fsspec URL), each opened
    once and kept open until :meth:`close`, and the verified reading of chunks from them.

    ``manifest_chunks``: the manifest's chunk table (None for a stock DCP checkpoint: nothing to
    check the payloads against). ``shapes``: :func:`chunk_shapes` of the metadata, so that plain
    records are read without ``torch.load``. Use as a context manager."""

    def __init__(self, directory: str, manifest_chunks: dict[str, Any] | None,
                 shapes: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> None:
        self.directory = directory
        self.manifest_chunks = manifest_chunks
        self.shapes = shapes or {}
        self._open: dict[str, IO[bytes] | OSError] = {}

    def __enter__(self) -> "ChunkFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def path(self, relative_path: str) -> str:
        return fs.join(self.directory, relative_path)

    def handle(self, relative_path: str) -> IO[bytes]:
        """The open file; raises the ``OSError`` of opening it (remembered: no second attempt)."""
        f = self._open.get(relative_path)
        if f is None:
            try:
                f = fs.open_file(self.path(relative_path))
            except OSError as e:
                f = e
            self._open[relative_path] = f
        if isinstance(f, OSError):
            raise f
        return f

    def open(self, relative_path: str, key: str) -> IO[bytes]:
        """The open file; a :class:`CorruptCheckpointError` naming the file and ``key`` (a key it
        is needed for) when it cannot be opened."""
        try:
            return self.handle(relative_path)
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path(relative_path)}: cannot open ({e.strerror}), needed for key '{key}'") from None

    def read(self, index: MetadataIndex, info: Any, out: torch.Tensor | None = None) -> torch.Tensor | bytes:
        """The chunk's verified payload (see :func:`read_chunk`; into ``out`` when given); a
        one-line :class:`CorruptCheckpointError` naming the file and key otherwise."""
        f = self.open(info.relative_path, index.fqn)
        try:
            return read_chunk(f, info, index, self.manifest_chunks, self.shapes.get(index), out)
        except ChunkFault as e:
            raise CorruptCheckpointError(f"{chunk_location(self.path(info.relative_path), index)}: {e}") from None

    def fault(self, index: MetadataIndex, info: Any) -> str | None:
        """What is wrong with the chunk (it is read and checked, then dropped); None if nothing."""
        try:
            f = self.handle(info.relative_path)
        except OSError as e:
            return f"cannot open ({e.strerror})"
        try:
            read_chunk(f, info, index, self.manifest_chunks, self.shapes.get(index))
        except ChunkFault as e:
            return str(e)
        return None

    def release(self, relative_path: str) -> None:
        """Close one file (once its chunks are read; it is opened again if needed)."""
        f = self._open.pop(relative_path, None)
        if f is not None and not isinstance(f, OSError):
            f.close()

    def close(self) -> None:
        for f in self._open.values():
            if not isinstance(f, OSError):
                f.close()
        self._open = {}


def coverage_faults(key: str, md: TensorStorageMetadata) -> list[Fault]:
    """Whether the chunks of tensor ``key`` cover it exactly once, from metadata alone: every
    chunk in bounds, no two overlapping, and their volumes summing to the tensor's. Returns the
    faults (empty: covered exactly once), in chunk order.

    Chunks are compared pairwise only where their first-dimension ranges meet (a sweep over the
    chunks sorted by first offset), so the usual row-wise boxes cost about n log n, not n²."""
    faults = []
    size = tuple(md.size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    for off, sz in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            faults.append(Fault(None, key, off, f"chunk of size {list(sz)} lies outside the tensor {list(size)}"))
    for i, j in _overlapping_pairs(boxes):
        faults.append(Fault(None, key, boxes[j][0], f"chunk overlaps the chunk at {list(boxes[i][0])}"))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size) and not faults:
        faults.append(Fault(None, key, None, f"chunks cover {covered} of {math.prod(size)} elements"))
    return faults


def _overlaps(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    (oa, sa), (ob, sb) = a, b
    return all(a0 < b0 + bs and b0 < a0 + as_ for a0, as_, b0, bs in zip(oa, sa, ob, sb))


def _overlapping_pairs(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[int, int]]:
    """Every pair ``(i, j)``, ``i < j``, of overlapping boxes, sorted."""
    if any(not off or not sz for off, sz in boxes):  # 0-d (or malformed): no first dimension to sweep
        return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if _overlaps(boxes[i], boxes[j])]
    pairs = []
    active: list[int] = []  # earlier boxes whose first-dimension range reaches past the current start
    for j in sorted(range(len(boxes)), key=lambda k: boxes[k][0][0]):
        start = boxes[j][0][0]
        active = [i for i in active if boxes[i][0][0] + boxes[i][1][0] > start]
        pairs += [(min(i, j), max(i, j)) for i in active if _overlaps(boxes[i], boxes[j])]
        active.append(j)
    return sorted(pairs)
