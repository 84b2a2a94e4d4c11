"""Reading chunks straight into their destinations, for ``load(atomic=False)``.

The all-or-nothing load (:mod:`mfsdp_ckpt.read.staged_read`) reads every chunk twice: once to
verify it, and again, after every rank has verified everything, into place. That costs one more
pass over the bytes than the disk needs. A load into freshly initialised weights (a resuming
trainer) has nothing to protect, so here each chunk's tensor bytes are read with ``os.preadv``
straight into the memory of the tensors they are loaded into, in blocks of :data:`BLOCK_BYTES`
spread over threads, and each block's crc32c is computed as soon as it arrives, while it is still
in the CPU's cache. A chunk's block checksums are joined (:func:`~mfsdp_ckpt.format.checksum.crc32c_combine`)
and compared with the manifest once its last block is in. A bad chunk is reported after the reads,
and its destination holds whatever was read: the model is partly loaded.

A chunk qualifies when it is a plain record (:mod:`mfsdp_ckpt.read.records`) of a local file and
each read request on it lands in a contiguous CPU tensor of its dtype, covering a contiguous byte
range of the chunk (any box of a flat-sharded state does: one row range, or part of one row).
The chunk's bytes no request wants (another rank's share of it, when the layout changed) are read
into scratch memory, one block at a time, for the checksum. Everything else goes through the
staged reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy
import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.metadata import MetadataIndex

from mfsdp_ckpt.errors import ChunkFault, CorruptCheckpointError
from mfsdp_ckpt.format.checksum import crc32c, crc32c_combine
from mfsdp_ckpt.read.chunks import ChunkFiles, chunk_location, expected_crc, missing_bytes
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.read.staged_read import ThreadRunner, file_descriptor
from mfsdp_ckpt.storage.positioned import pread_into

__all__ = ["BLOCK_BYTES", "DirectChunk", "direct_chunk", "direct_part", "read_into_place"]

BLOCK_BYTES = 4 << 20  # one read and checksum: small enough to still be in the cache when checked


@dataclass
class DirectChunk:
    """One chunk to read into place: its tensor bytes start at ``data_offset`` of its file;
    ``segments`` are (start, end, destination) byte ranges of those bytes, in order, covering all
    of them (destination None: read into scratch memory, only for the checksum)."""

    index: MetadataIndex
    info: Any
    data_offset: int
    nbytes: int
    expected: int | None
    segments: list[tuple[int, int, numpy.ndarray | None]]
    targets: list[torch.Tensor] = field(default_factory=list)


def _contiguous_range(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """The element range ``[start, end)`` of a row-major tensor of ``shape`` that the box
    ``offsets``/``lengths`` is, when the box is one contiguous range of it; else None."""
    dims = len(shape)
    first = next((d for d in range(dims) if lengths[d] != 1), dims)  # leading dims of length 1
    if any(lengths[d] != shape[d] for d in range(first + 1, dims)):
        return None
    start, stride = 0, 1
    for d in reversed(range(dims)):
        start += offsets[d] * stride
        stride *= shape[d]
    return start, start + math.prod(lengths)


def _host_bytes(target: torch.Tensor, dtype: torch.dtype, numel: int) -> numpy.ndarray | None:
    """``target``'s memory as bytes, when a read can land in it: a contiguous CPU tensor of
    ``dtype`` and ``numel`` elements."""
    if target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous() or target.numel() != numel:
        return None
    if numel == 0:
        return numpy.empty(0, dtype=numpy.uint8)
    return target.reshape(-1).view(torch.uint8).numpy()


def _checked(
    files: ChunkFiles, index: MetadataIndex, info: Any
) -> tuple[torch.dtype, tuple[int, ...], Any, int | None]:
    """The chunk's dtype, shape, open file and expected crc32c; raises
    :class:`CorruptCheckpointError` for a chunk misplaced in the manifest or truncated."""
    dtype, shape = files.shapes[index]
    f = files.open(info.relative_path, index.fqn)
    try:
        expected = expected_crc(info, index, files.manifest_chunks)
        truncated = missing_bytes(f, info)
        if truncated:
            raise ChunkFault(truncated)
    except ChunkFault as e:
        raise CorruptCheckpointError(f"{chunk_location(files.path(info.relative_path), index)}: {e}") from None
    return dtype, tuple(shape), f, expected


def _qualifies(files: ChunkFiles, index: MetadataIndex, info: Any) -> bool:
    """Whether the chunk can be read into place: a tensor chunk of known shape, stored without
    stream transforms, in a local file."""
    return (
        index.offset is not None
        and index in files.shapes
        and not getattr(info, "transform_descriptors", None)
        and file_descriptor(files.open(info.relative_path, index.fqn)) is not None
    )


def direct_part(
    files: ChunkFiles, index: MetadataIndex, info: Any, start: int, end: int, dest: torch.Tensor
) -> DirectChunk | None:
    """Elements ``[start, end)`` of the chunk (its row-major flattening) to be read straight into
    ``dest`` (a contiguous CPU tensor of the chunk's dtype and ``end - start`` elements), the
    rest of its bytes into scratch for the checksum (:func:`read_into_place`); None when the
    chunk does not qualify (not a plain record of a local file). For a reader that wants part of
    a chunk (the offline reshard) and would otherwise read all of it into a temporary and copy
    the part out. Raises :class:`CorruptCheckpointError` for a chunk misplaced or truncated."""
    if not _qualifies(files, index, info):
        return None
    dtype, shape, f, expected = _checked(files, index, info)
    memory = _host_bytes(dest, dtype, end - start)
    if memory is None or not 0 <= start <= end <= math.prod(shape):
        return None
    raw = locate_raw_tensor(f, info.offset, info.length, dtype, math.prod(shape))
    if raw is None:
        return None
    segments = _segments([(start * dtype.itemsize, end * dtype.itemsize, memory)], raw.nbytes)
    return DirectChunk(index, info, raw.offset, raw.nbytes, expected, segments or [], [dest])


def direct_chunk(
    files: ChunkFiles,
    index: MetadataIndex,
    info: Any,
    reqs: Sequence[Any],
    resolve: Any,
) -> DirectChunk | None:
    """The chunk as a :class:`DirectChunk` when it qualifies (see the module docstring); None
    otherwise. ``resolve(req)`` is the load planner's destination of a read request. Raises
    :class:`CorruptCheckpointError` for a chunk misplaced in the manifest or truncated."""
    if not _qualifies(files, index, info):
        return None
    dtype, shape, f, expected = _checked(files, index, info)
    pieces, targets = [], []
    for req in reqs:
        span = _contiguous_range(shape, req.storage_offsets, req.lengths)
        target = resolve(req).detach()
        memory = None if span is None else _host_bytes(target, dtype, span[1] - span[0])
        if memory is None:
            return None
        pieces.append((span[0] * dtype.itemsize, span[1] * dtype.itemsize, memory))
        targets.append(target)
    raw = locate_raw_tensor(f, info.offset, info.length, dtype, math.prod(shape))
    if raw is None:
        return None
    segments = _segments(sorted(pieces, key=lambda p: p[0]), raw.nbytes)
    if segments is None:
        return None
    return DirectChunk(index, info, raw.offset, raw.nbytes, expected, segments, targets)


def _segments(
    pieces: list[tuple[int, int, numpy.ndarray]], nbytes: int
) -> list[tuple[int, int, numpy.ndarray | None]] | None:
    """``pieces`` (sorted by start) with the gaps between them as scratch segments; None when
    two pieces overlap (two destinations of the same bytes: left to the staged reader)."""
    out: list[tuple[int, int, numpy.ndarray | None]] = []
    at = 0
    for start, end, memory in pieces:
        if start < at:
            return None
        if start > at:
            out.append((at, start, None))
        if end > start:
            out.append((start, end, memory))
        at = end
    if at < nbytes:
        out.append((at, nbytes, None))
    return out


def read_into_place(files: ChunkFiles, chunks: Sequence[DirectChunk], *, threads: int) -> None:
    """Read every chunk's bytes into its destinations and check its crc32c; raises the first bad
    chunk in file order as one :class:`CorruptCheckpointError`, after all reads have stopped
    (destinations already written keep what was read)."""
    blocks = [
        (c, s, lo, min(lo + BLOCK_BYTES, end))
        for c, chunk in enumerate(chunks)
        for s, (start, end, _) in enumerate(chunk.segments)
        for lo in range(start, end, BLOCK_BYTES)
    ]
    sums: list[int | str | None] = [None] * len(blocks)  # a block's crc32c, or why it could not be read

    def read_block(b: int) -> None:
        c, s, lo, hi = blocks[b]
        chunk = chunks[c]
        start, _, memory = chunk.segments[s]
        out = numpy.empty(hi - lo, dtype=numpy.uint8) if memory is None else memory[lo - start : hi - start]
        sums[b] = _read_fully(files, chunk, chunk.data_offset + lo, out)

    with ThreadRunner(threads if sum(c.nbytes for c in chunks) > BLOCK_BYTES else 1) as run:
        run(read_block, len(blocks))
    faults = _check_sums(chunks, blocks, sums)
    for chunk in chunks:
        for target in chunk.targets:
            increment_version(target)  # written through numpy: torch's version counter did not see it
    if faults:
        chunk, problem = min(faults, key=lambda fault: (fault[0].info.relative_path, fault[0].info.offset))
        raise CorruptCheckpointError(f"{chunk_location(files.path(chunk.info.relative_path), chunk.index)}: {problem}")


def _read_fully(files: ChunkFiles, chunk: DirectChunk, offset: int, out: numpy.ndarray) -> int | str:
    """Read ``len(out)`` bytes at ``offset`` of the chunk's file into ``out``: their crc32c, or
    why they could not be read."""
    fd = files.handle(chunk.info.relative_path).fileno()
    try:
        done = pread_into(fd, out, offset)
    except OSError as e:
        return f"cannot read ({e.strerror or e})"
    if done < len(out):
        return "truncated tensor data"
    return crc32c(out)


def _check_sums(
    chunks: Sequence[DirectChunk], blocks: Sequence[tuple[int, int, int, int]], sums: Sequence[int | str | None]
) -> list[tuple[DirectChunk, str]]:
    """Each chunk's crc32c joined from its blocks', against the manifest's: the faults."""
    crcs: list[int | str] = [0] * len(chunks)
    for (c, _, lo, hi), value in zip(blocks, sums):
        if isinstance(crcs[c], str):
            continue
        if not isinstance(value, int):
            crcs[c] = value or "not read"
            continue
        crcs[c] = crc32c_combine(crcs[c], value, hi - lo) if lo else value
    faults = []
    for chunk, crc in zip(chunks, crcs):
        if isinstance(crc, str):
            faults.append((chunk, crc))
        elif chunk.expected is not None and crc != chunk.expected:
            faults.append((chunk, "checksum mismatch"))
    return faults
