"""Whole-entry reads of any DCP checkpoint, one tensor at a time, for the offline tools
(``reshard``, the HF bridge, ``convert``): :class:`CheckpointReader` returns one entry, assembled
from its chunks and verified against the manifest. Several threads read one checkpoint through
one :meth:`CheckpointReader.fork` each (a reader shares the parsed metadata, not its open files).
A caller that reads many tensors reuses one buffer through ``read(key, out=...)``. Small chunks
that lie next to each other in one file are read as one range (:func:`coalesce`); large ones go
straight into place.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Iterator, Sequence

import numpy
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import CheckpointError, ChunkFault, CorruptCheckpointError
from mfsdp_ckpt.format.names import shown
from mfsdp_ckpt.read.chunks import (
    ChunkFiles,
    MemoryFile,
    chunk_location,
    read_chunk,
)
from mfsdp_ckpt.read.direct_read import DirectChunk, direct_part, read_into_place
from mfsdp_ckpt.read.metadata_check import entry_faults

__all__ = ["CheckpointReader", "coalesce", "compact"]


class CheckpointReader:
    """One whole entry (tensor or object) at a time from a checkpoint, every chunk verified.

    Peak memory of :meth:`read` is the tensor plus its largest chunk. Use as a context manager
    (it keeps the data files open)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from mfsdp_ckpt.read.locate import open_checkpoint

        self.directory, self.manifest, self.metadata, verifying = open_checkpoint(os.fspath(path))
        self._chunks_by_key: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = verifying.stored
        self._shapes = verifying.chunk_shapes
        self._chunks = ChunkFiles(self.directory, verifying.manifest_chunks, self._shapes)
        self._sound: set[str] = set()  # entries whose metadata and files were checked (see _check_entry)

    def fork(self) -> "CheckpointReader":
        """Another reader of the same checkpoint, for another thread: the metadata checked once,
        shared (read-only); its own open files (a file object is not shared between threads: a
        read is a seek and a read). Close it like any reader."""
        other = object.__new__(CheckpointReader)
        other.directory, other.manifest, other.metadata = self.directory, self.manifest, self.metadata
        other._chunks_by_key, other._shapes = self._chunks_by_key, self._shapes
        other._chunks = ChunkFiles(self.directory, self._chunks.manifest_chunks, self._shapes)
        other._sound = set()
        return other

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._chunks.close()

    def keys(self) -> list[str]:
        return sorted(self.metadata.state_dict_metadata)

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata[key], TensorStorageMetadata)

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    # chunk-level access, for readers of stored layouts that are not ours (mfsdp_ckpt.mcore reads one
    # layer of a layer-stacked tensor): every chunk still goes through the same checks

    def check_entry(self, key: str) -> None:
        """Raise :class:`CorruptCheckpointError` unless entry ``key``'s metadata is sound and its
        files hold every chunk's byte range (see :meth:`_check_entry`)."""
        self._check_entry(key, self.metadata.state_dict_metadata[key])

    def stored_chunks(self, key: str) -> list[tuple[MetadataIndex, _StorageInfo]]:
        """Where each chunk of ``key`` lies: its index (offsets) and storage (file, range)."""
        return list(self._chunks_by_key.get(key, []))

    def read_chunk(self, index: MetadataIndex, info: _StorageInfo) -> torch.Tensor | Any:
        """One chunk's verified payload (a tensor, or the object a non-tensor entry holds)."""
        return self._chunks.read(index, info)

    def open_data_file(self, relative_path: str, key: str) -> Any:
        """The open data file ``relative_path`` (inside the checkpoint, a regular file), for
        reading ranges of it; ``key`` names the entry in errors."""
        return self._chunks.open(relative_path, key)

    def _payload(
        self, index: MetadataIndex, info: _StorageInfo, out: torch.Tensor | None = None
    ) -> torch.Tensor | bytes:
        """The chunk's verified payload (read into ``out`` when given)."""
        return self._chunks.read(index, info, out)

    def _check_entry(self, key: str, md: Any) -> None:
        """Refuse an entry whose metadata is not sound (:func:`~mfsdp_ckpt.read.metadata_check.entry_faults`:
        chunks not covering a tensor exactly once, chunks listed but not stored or stored but not
        listed, chunks whose elements do not fit in their bytes) or whose chunks' files do not hold
        their byte ranges: all before reading or allocating anything."""
        if key in self._sound:
            return
        faults = entry_faults(key, md, self._chunks_by_key.get(key, []))
        if faults:
            first = faults[0]
            if first.file is None:  # coverage, from the chunk list alone
                coverage = [f for f in faults if f.file is None]
                more = f" (and {len(coverage) - 1} more)" if len(coverage) > 1 else ""
                raise CorruptCheckpointError(f"{self.directory}: {first}{more}")
            at = f" chunk at {list(first.offset)}" if first.offset is not None else ""
            raise CorruptCheckpointError(f"{self.directory}: key '{key}'{at}: {first.message}")
        self._chunks.require_present(self._chunks_by_key.get(key, []))
        self._sound.add(key)

    def read(self, key: str, out: torch.Tensor | None = None) -> Any:
        """The entry ``key``: a full tensor, or the object (unpickled with ``weights_only``).

        ``out``: a contiguous tensor of the entry's dtype and shape to read the tensor into (and
        return), e.g. a view of a buffer the caller reuses for every tensor."""
        md = self.metadata.state_dict_metadata.get(key)
        if md is None:
            raise CheckpointError(f"{self.directory}: no key '{shown(key)}'")
        self._check_entry(key, md)
        chunks = self._chunks_by_key.get(key, [])
        if not isinstance(md, TensorStorageMetadata):
            if out is not None:
                raise CheckpointError(
                    f"{self.directory}: key '{shown(key)}' is an object, not a tensor to read into out"
                )
            data = self._payload(*chunks[0])
            try:
                return torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:  # noqa: BLE001 - whatever torch.load makes of hostile bytes
                raise CorruptCheckpointError(
                    f"{self.directory}: key '{key}': object not loadable with weights_only ({type(e).__name__})"
                ) from None
        if out is not None and (out.dtype != md.properties.dtype or out.shape != md.size or not out.is_contiguous()):
            raise CheckpointError(
                f"{self.directory}: key '{key}' is {md.properties.dtype} {tuple(md.size)}; "
                f"cannot read it into a {'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} {tuple(out.shape)}"
            )
        if all(_contiguous_flat_start(c.offsets, c.sizes, md.size) is not None for c in md.chunks):
            flat = None if out is None else out.view(-1)
            return self.read_flat(key, 0, md.size.numel(), out=flat).view(md.size)  # every chunk straight into place
        if out is None:
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = 0
        for (index, _info), piece in self._payloads(sorted(chunks, key=lambda c: (c[1].relative_path, c[1].offset))):
            assert isinstance(piece, torch.Tensor)
            region = out
            for dim, (o, s) in enumerate(zip(index.offset, piece.shape)):
                region = region.narrow(dim, o, s) if o + s <= region.shape[dim] else region.narrow(dim, 0, 0)
            if piece.dtype != out.dtype or region.shape != piece.shape:
                raise CorruptCheckpointError(
                    f"{self.directory}: key '{key}' chunk at {list(index.offset)}: holds {piece.dtype} {tuple(piece.shape)}, "
                    f"which does not fit {md.properties.dtype} {tuple(md.size)}"
                )
            region.copy_(piece)
            covered += piece.numel()
            del piece
        if covered != out.numel():
            raise CorruptCheckpointError(
                f"{self.directory}: key '{key}': chunks cover {covered} of {out.numel()} elements"
            )
        return out

    def read_flat(self, key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the row-major flattening of tensor ``key``, as a new 1-D
        tensor (or in ``out``, a contiguous 1-D tensor of ``end - start`` elements of the key's
        dtype), reading only the chunks that overlap the range (each whole, so its crc32c is
        checked). Chunks lying inside the range are read straight into place, and so is the
        wanted part of a large chunk lying across its ends (a plain record of a local file: the
        rest of its bytes pass through a scratch block for the checksum,
        :func:`~mfsdp_ckpt.read.direct_read.direct_part`); small neighbours in one file are read
        as one range (:func:`coalesce`). Peak memory: the range plus one chunk (or one coalesced
        range, at most :data:`COALESCE_BYTES`), or plus a scratch block where the large chunks
        qualify."""
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.directory}: no tensor '{shown(key)}'")
        if not 0 <= start <= end <= math.prod(md.size):
            raise CheckpointError(
                f"{self.directory}: key '{key}': elements [{start}, {end}) lie outside its {math.prod(md.size)}"
            )
        self._check_entry(key, md)
        shape, dtype = tuple(md.size), md.properties.dtype
        if out is None:
            out = torch.empty(end - start, dtype=dtype)
        elif out.dtype != dtype or out.shape != (end - start,) or not out.is_contiguous():
            raise CheckpointError(
                f"{self.directory}: key '{key}': elements [{start}, {end}) of {dtype} do not fit "
                f"out ({out.dtype} {tuple(out.shape)})"
            )
        if start == end:
            return out
        placed = []
        sizes_at = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        for index, info in self._chunks_by_key.get(key, []):
            sizes = sizes_at[tuple(index.offset)]  # every stored chunk is listed (_check_entry)
            flat0 = _contiguous_flat_start(index.offset, sizes, shape)
            if flat0 is None:  # not one run of the flattening (e.g. a column shard): the slow way
                return out.copy_(self.read(key).reshape(-1)[start:end])
            placed.append((flat0, math.prod(sizes), index, info))
        covered = 0
        wanted = []  # (index, info, where its payload goes: a slice of out, or None for a temporary)
        parts: list[DirectChunk] = []  # chunks of which only a part is wanted, read into place
        for flat0, n, index, info in sorted(placed, key=lambda c: (c[3].relative_path, c[3].offset)):
            lo, hi = max(flat0, start), min(flat0 + n, end)
            if lo >= hi:
                continue
            covered += hi - lo
            inside = lo == flat0 and hi == flat0 + n
            if not inside and info.length > COALESCE_CHUNK_BYTES:  # its part straight into place, if it can
                part = direct_part(self._chunks, index, info, lo - flat0, hi - flat0, out[lo - start : hi - start])
                if part is not None:
                    parts.append(part)
                    continue
            wanted.append(((index, info), out[lo - start : hi - start] if inside else None, (flat0, n, lo, hi)))
        if parts:  # one thread: the offline tools run one reader per worker thread
            read_into_place(self._chunks, parts, threads=1)
        for ((_index, _info), piece), (_, target, (flat0, _n, lo, hi)) in zip(
            self._payloads([w[0] for w in wanted], [w[1] for w in wanted]), wanted
        ):
            if target is None:
                out[lo - start : hi - start].copy_(piece.reshape(-1)[lo - flat0 : hi - flat0])
            del piece
        if covered != end - start:
            raise CorruptCheckpointError(
                f"{self.directory}: key '{key}': chunks cover {covered} of elements [{start}, {end})"
            )
        return out

    def _payloads(
        self, chunks: Sequence[tuple[MetadataIndex, _StorageInfo]], targets: Sequence[torch.Tensor | None] | None = None
    ) -> Iterator[tuple[tuple[MetadataIndex, _StorageInfo], Any]]:
        """Each chunk with its verified payload, in the order given (read into ``targets[i]``
        where one is given). Runs of small chunks that lie next to each other in one file are
        read with one read of their whole range (:func:`coalesce`), then each is checked and
        copied out of it; the others are read alone, straight into place."""
        targets = list(targets) if targets is not None else [None] * len(chunks)
        for run in coalesce(list(chunks)):
            if len(run) == 1:
                i = run[0]
                yield chunks[i], self._payload(*chunks[i], targets[i])
                continue
            first, last = chunks[run[0]][1], chunks[run[-1]][1]
            f = self._chunks.open(first.relative_path, chunks[run[0]][0].fqn)
            window = _read_window(f, first.offset, last.offset + last.length - first.offset)
            for i in run:  # each chunk checked as ever (completeness, manifest entry, crc32c), from memory
                index, info = chunks[i]
                try:
                    payload = read_chunk(
                        window, info, index, self._chunks.manifest_chunks, self._shapes.get(index), targets[i]
                    )
                except ChunkFault as e:
                    raise CorruptCheckpointError(
                        f"{chunk_location(self._chunks.path(info.relative_path), index)}: {e}"
                    ) from None
                yield chunks[i], payload
            del window


#: chunks up to this size are read together with their neighbours in one file
COALESCE_CHUNK_BYTES = 1 << 20
#: the most bytes one coalesced read holds in memory
COALESCE_BYTES = 16 << 20


def coalesce(
    chunks: Sequence[tuple[MetadataIndex, Any]], *, small: int = COALESCE_CHUNK_BYTES, limit: int = COALESCE_BYTES
) -> list[list[int]]:
    """Group the positions of ``chunks`` (in the given order) into runs that one read serves:
    consecutive chunks of at most ``small`` bytes each that follow each other without a gap in
    one file, at most ``limit`` bytes per run. Large chunks stay alone (read straight into
    their destination, no intermediate copy); so does everything on a gap."""
    runs: list[list[int]] = []
    for i, (_, info) in enumerate(chunks):
        if runs and info.length <= small:
            prev = chunks[runs[-1][-1]][1]
            start = chunks[runs[-1][0]][1].offset
            if (
                prev.relative_path == info.relative_path
                and prev.length <= small
                and prev.offset + prev.length == info.offset
                and info.offset + info.length - start <= limit
            ):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _read_window(f: Any, offset: int, length: int) -> MemoryFile:
    """Bytes ``[offset, offset + length)`` of ``f`` read into memory in one read, as a file
    addressed at ``f``'s own offsets (a short read leaves a shorter window)."""
    buf = bytearray(length)
    f.seek(offset)
    got = f.readinto(buf) or 0
    return MemoryFile(buf if got == length else buf[:got], base=offset)


def _contiguous_flat_start(offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int]) -> int | None:
    """Where a box starts in the row-major flattening of ``shape``, if the box is one contiguous
    run there (leading sizes 1, then one partial dim, then whole dims); else None."""
    k = next((i for i, s in enumerate(sizes) if s != 1), len(sizes))
    if any(s != d for s, d in zip(sizes[k + 1 :], shape[k + 1 :])):
        return None
    flat, stride = 0, 1
    for o, d in zip(reversed(offsets), reversed(shape)):
        flat += o * stride
        stride *= d
    return flat


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with the same values whose storage is exactly its bytes, without copying when
    ``tensor`` is contiguous (``torch.save`` writes a view's whole storage otherwise)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() == nbytes and tensor.storage_offset() == 0 and tensor.is_contiguous():
        return tensor
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor.clone(memory_format=torch.contiguous_format)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()  # shares memory
    return torch.from_numpy(numpy.ascontiguousarray(raw)).view(tensor.dtype).reshape(tensor.shape)
