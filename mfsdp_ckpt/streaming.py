"""Whole-entry reads and chunk-at-a-time writes of canonical checkpoints.

Offline tools (``reshard``, the HF bridge, ``convert``) hold one tensor at a time, never the whole
checkpoint: :class:`CheckpointReader` returns one entry, assembled from its chunks and verified
against the manifest; :class:`CheckpointBuilder` appends chunks to data files as they come and
commits the directory (``.metadata``, then ``mfsdp.json``, then one rename) only when every key is
covered exactly once. The files are the stock DCP format, so PyTorch's own readers load them.

Several threads read one checkpoint through one :meth:`CheckpointReader.fork` each (a reader
shares the parsed metadata, but not its open files). A caller that reads many tensors reuses one
buffer through ``read(key, out=...)``, so the pages of a fresh allocation are not faulted in again
for every tensor. Small chunks that lie next to each other in one file are read as one range
(:func:`coalesce`); large ones go straight into place.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mfsdp_ckpt import fs
from mfsdp_ckpt.chunks import (
    ChunkFault,
    ChunkFiles,
    MemoryFile,
    chunk_location,
    coverage_faults,
    read_chunk,
)
from mfsdp_ckpt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from mfsdp_ckpt.lock import run_lock
from mfsdp_ckpt.manifest import completed, write_manifest
from mfsdp_ckpt.metadata_check import entry_faults
from mfsdp_ckpt.names import MANIFEST_NAME, METADATA_NAME, shown
from mfsdp_ckpt.planner import chunk_id, payload_crc32c
from mfsdp_ckpt.records import without_zip_crc
from mfsdp_ckpt.staging import check_destination, commit_directory, fsync_dir, make_partial_dir
from mfsdp_ckpt.write_errors import RecordingStream, reporting
from mfsdp_ckpt.writeback import WritebackStream, start_writeback

__all__ = ["CheckpointReader", "CheckpointBuilder", "ChunkFileWriter", "ChunkRecord", "compact"]


class CheckpointReader:
    """One whole entry (tensor or object) at a time from a checkpoint, every chunk verified.

    Peak memory of :meth:`read` is the tensor plus its largest chunk. Use as a context manager
    (it keeps the data files open)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from mfsdp_ckpt.locate import open_checkpoint

        self.directory, self.manifest, self.metadata, verifying = open_checkpoint(os.fspath(path))
        self._chunks_by_key: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = verifying.stored
        self._shapes = verifying.chunk_shapes
        self._chunks = ChunkFiles(self.directory, self.manifest["chunks"] if self.manifest else None, self._shapes)
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
        """Refuse an entry whose metadata is not sound (:func:`~mfsdp_ckpt.metadata_check.entry_faults`:
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
            except Exception as e:
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
        checked). Chunks lying inside the range are read straight into place; small neighbours
        in one file are read as one range (:func:`coalesce`). Peak memory: the range plus one
        chunk (or one coalesced range, at most :data:`COALESCE_BYTES`)."""
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
        for flat0, n, index, info in sorted(placed, key=lambda c: (c[3].relative_path, c[3].offset)):
            lo, hi = max(flat0, start), min(flat0 + n, end)
            if lo >= hi:
                continue
            covered += hi - lo
            inside = lo == flat0 and hi == flat0 + n
            wanted.append(((index, info), out[lo - start : hi - start] if inside else None, (flat0, n, lo, hi)))
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


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk written to a data file: what :class:`CheckpointBuilder` needs to list it (plain
    data, so another process can write chunks and hand the records back)."""

    key: str
    dtype: torch.dtype | None  # None: a serialized object
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32c: int


class ChunkFileWriter:
    """Appends chunks to data files ``__{i}_0.distcp`` in ``directory`` and returns their records.
    One writer per file: two writers must not share a file index."""

    def __init__(self, directory: str, *, sync: bool = True) -> None:
        self.directory = directory
        self.sync = sync
        self._files: dict[int, RecordingStream] = {}
        self._index: dict[str, int] = {}  # file name -> file index
        self.bytes_written = 0

    def _append(self, file: int, payload: torch.Tensor | bytes) -> tuple[str, int, int]:
        name = f"__{file}_0.distcp"
        path = fs.join(self.directory, name)
        f = self._files.get(file)
        if f is None:
            self._index[name] = file
            with reporting(path):
                opened = fs.open_file(path, "wb")
                f = self._files[file] = RecordingStream(WritebackStream(opened) if self.sync else opened, path)
        with reporting(path, [f]):
            offset = f.tell()
            if isinstance(payload, bytes):
                f.write(payload)
            else:
                with without_zip_crc():
                    torch.save(payload, f)
            length = f.tell() - offset
        self.bytes_written += length
        return name, offset, length

    def write_chunk(
        self,
        key: str,
        chunk: torch.Tensor,
        offsets: Sequence[int],
        shape: Sequence[int],
        file: int,
        crc32c: int | None = None,
    ) -> ChunkRecord:
        """Append ``chunk`` (the box of ``key`` at ``offsets`` of a ``shape`` tensor) to data file
        ``file``. ``crc32c``: the chunk's :func:`~mfsdp_ckpt.planner.payload_crc32c`, if the
        caller computed it already (e.g. on another thread, while an earlier chunk was written);
        else it is computed here. A wrong one fails every later read of the chunk."""
        shape, offsets = tuple(shape), tuple(offsets)
        if (
            len(offsets) != len(shape)
            or chunk.dim() != len(shape)
            or any(o < 0 or o + s > d for o, s, d in zip(offsets, chunk.shape, shape))
        ):
            raise CheckpointError(f"key '{key}': chunk {tuple(chunk.shape)} at {list(offsets)} lies outside {shape}")
        payload = compact(chunk.detach().cpu())
        name, offset, length = self._append(file, payload)
        crc = payload_crc32c(payload) if crc32c is None else crc32c
        return ChunkRecord(key, chunk.dtype, shape, offsets, tuple(chunk.shape), name, offset, length, crc)

    def start_writeback(self, record: ChunkRecord) -> None:
        """Start the write-back of the bytes of ``record`` that reached the file (see
        :func:`~mfsdp_ckpt.writeback.start_writeback`; a hint, nothing if the file is closed)."""
        f = self._files.get(self._index.get(record.file, -1))
        try:
            fd = f.fileno() if f is not None else -1
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return
        if fd >= 0:
            start_writeback(fd, record.offset, record.length)

    def write_object(self, key: str, value: Any, file: int) -> ChunkRecord:
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
        name, offset, length = self._append(file, data)
        return ChunkRecord(key, None, (), (), (), name, offset, length, payload_crc32c(data))

    def close(self) -> None:
        """Flush (and fsync, locally) every file; on an object store this completes the uploads.
        If one fails, the others are discarded (nothing is left to flush at interpreter exit)."""
        try:
            for file in list(self._files):
                self.close_file(file)
        except BaseException:
            self.discard()
            raise

    def close_file(self, file: int) -> None:
        """Finish data file ``file`` (a writer that is done with a file closes it, so that the
        number of open files stays small whatever the number of target ranks)."""
        f = self._files.pop(file, None)
        if f is None:
            return
        with reporting(f.path, [f]):
            try:
                f.flush()
                if self.sync and not fs.is_url(self.directory):
                    os.fsync(f.fileno())
                f.close()
            except BaseException:
                self._files[file] = f  # for discard()
                raise

    def discard(self) -> None:
        """Close without completing: an object store drops the unfinished uploads."""
        files, self._files = list(self._files.values()), {}
        for f in files:
            with contextlib.suppress(Exception):
                (getattr(f, "discard", None) or f.close)()
            with contextlib.suppress(Exception):
                if not f.closed:
                    f.close()


class CheckpointBuilder:
    """Builds a committed checkpoint from chunks appended one at a time.

    ``file=i`` puts a chunk in the data file ``__{i}_0.distcp``; choose it per chunk so that each
    future reader rank reads one contiguous file. Other processes may write files into
    :attr:`tmp` with their own :class:`ChunkFileWriter` and hand back the records
    (:meth:`add_records`). Nothing is visible at ``path`` until :meth:`commit`; on an exception
    inside ``with`` (or :meth:`abort`) what was written is removed and ``path`` is untouched.

    ``path`` may be an fsspec URL. An object store has no rename: files are written in place and
    the checkpoint is committed by writing ``mfsdp.json`` last (readers refuse a prefix without
    it); ``overwrite`` there first removes the old checkpoint's manifest, then its files."""

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: dict[str, Any],
        *,
        overwrite: bool = False,
        sync: bool = True,
        sources: Sequence[str | os.PathLike] = (),
    ) -> None:
        self.final = fs.normalize(path)
        self.remote = fs.is_url(self.final)
        self.overwrite = overwrite
        self.sync = sync
        self.manifest = dict(manifest)
        self._lock = contextlib.ExitStack()
        sources = tuple(fs.normalize(src) for src in sources)
        if self.remote:
            _check_remote_destination(self.final, overwrite=overwrite, sources=sources)
            if fs.exists(self.final):  # un-commit first, so a failure in between never leaves a complete-looking mix
                if fs.exists(fs.join(self.final, MANIFEST_NAME)):
                    fs.remove_tree(fs.join(self.final, MANIFEST_NAME))
                fs.remove_tree(self.final)
            self.tmp = self.final
        else:  # one writer at a time in the parent; refuse what would lose data before writing
            self._lock.enter_context(run_lock(os.path.dirname(self.final)))
            try:
                check_destination(
                    self.final,
                    overwrite=overwrite,
                    kind="checkpoint",
                    sources=tuple(s for s in sources if not fs.is_url(s)),
                )
                self.tmp = make_partial_dir(self.final)
            except BaseException:
                self._lock.close()
                raise
        self._writer = ChunkFileWriter(self.tmp, sync=sync)
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._objects: set[str] = set()
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._chunks: dict[str, dict[str, Any]] = {}
        self.committed = False

    def __enter__(self) -> "CheckpointBuilder":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None or not self.committed:
            self.abort()

    @property
    def bytes_written(self) -> int:
        return sum(c["length"] for c in self._chunks.values())

    def add_records(self, records: Sequence[ChunkRecord]) -> None:
        """List chunks already written into :attr:`tmp` (checks each key's dtype and shape agree
        and that no chunk is listed twice)."""
        for rec in records:
            if rec.dtype is None:
                if rec.key in self._tensors or rec.key in self._objects:
                    raise CheckpointError(f"key '{rec.key}': written twice")
                self._objects.add(rec.key)
                index = MetadataIndex(rec.key)
            else:
                if rec.key in self._objects:
                    raise CheckpointError(f"key '{rec.key}': already written as an object")
                md = self._tensors.get(rec.key)
                if md is None:
                    md = self._tensors[rec.key] = TensorStorageMetadata(
                        TensorProperties(dtype=rec.dtype), torch.Size(rec.shape), []
                    )
                elif tuple(md.size) != rec.shape or md.properties.dtype != rec.dtype:
                    raise CheckpointError(
                        f"key '{rec.key}': chunk {rec.dtype} of a {rec.shape} tensor, earlier chunks said "
                        f"{md.properties.dtype} {tuple(md.size)}"
                    )
                index = MetadataIndex(rec.key, torch.Size(rec.offsets))
                if index in self._storage:
                    raise CheckpointError(f"key '{rec.key}': a chunk at {list(rec.offsets)} was written twice")
                md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(rec.offsets), sizes=torch.Size(rec.sizes)))
            self._storage[index] = _StorageInfo(rec.file, rec.offset, rec.length)
            self._chunks[chunk_id(index)] = {
                "file": rec.file,
                "offset": rec.offset,
                "length": rec.length,
                "crc32c": rec.crc32c,
            }

    def add_chunk(
        self,
        key: str,
        chunk: torch.Tensor,
        offsets: Sequence[int],
        shape: Sequence[int],
        *,
        file: int = 0,
        crc32c: int | None = None,
    ) -> ChunkRecord:
        """Append the box of ``key`` (global ``shape``) at ``offsets`` holding ``chunk``
        (``crc32c``: its checksum, if already computed; see :meth:`ChunkFileWriter.write_chunk`)."""
        if key in self._objects:
            raise CheckpointError(f"key '{key}': already written as an object")
        if MetadataIndex(key, torch.Size(offsets)) in self._storage:
            raise CheckpointError(f"key '{key}': a chunk at {list(offsets)} was already written")
        record = self._writer.write_chunk(key, chunk, offsets, shape, file, crc32c)
        self.add_records([record])
        return record

    def add_tensor(self, key: str, tensor: torch.Tensor, *, file: int = 0, crc32c: int | None = None) -> ChunkRecord:
        """Append the whole tensor ``key`` as one chunk; returns where it went."""
        return self.add_chunk(key, tensor, (0,) * tensor.dim(), tensor.shape, file=file, crc32c=crc32c)

    def start_writeback(self, record: ChunkRecord) -> None:
        """Start writing ``record``'s bytes to disk now (a local file written with ``sync``; see
        :mod:`mfsdp_ckpt.writeback`), so the fsync at :meth:`commit` waits for less. May be called
        from another thread than the one appending, e.g. after handing the next append on."""
        if self.sync and not self.remote:
            self._writer.start_writeback(record)

    def add_object(self, key: str, value: Any, *, file: int = 0) -> None:
        """Append a plain object (saved with ``torch.save``; loaded back with ``weights_only``)."""
        if key in self._tensors or key in self._objects:
            raise CheckpointError(f"key '{key}': already written")
        self.add_records([self._writer.write_object(key, value, file)])

    def _check_coverage(self) -> None:
        bad = []
        for key, md in self._tensors.items():
            if coverage_faults(key, md):
                covered = sum(math.prod(c.sizes) for c in md.chunks)
                bad.append(f"{key} ({covered} of {math.prod(md.size)} elements, or overlapping chunks)")
        if bad:
            raise CheckpointError(f"{self.final}: not every tensor is covered exactly once: {', '.join(sorted(bad))}")

    def commit(self) -> str:
        """Check coverage, write ``.metadata`` and ``mfsdp.json``, and make the directory visible."""
        self._check_coverage()
        with reporting(self.final):
            return self._commit()

    def _commit(self) -> str:
        self._writer.close()
        save_id = str(uuid.uuid4())
        state_md: dict[str, Any] = dict(self._tensors)
        state_md.update((k, BytesStorageMetadata()) for k in self._objects)
        metadata = Metadata(
            state_dict_metadata=state_md,
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=self.final, save_id=save_id),
            version=CURRENT_DCP_VERSION,
        )
        fs.write_bytes(fs.join(self.tmp, METADATA_NAME), pickle.dumps(metadata), sync=self.sync)
        write_manifest(
            self.tmp, completed(self.manifest, save_id, self._chunks), sync=self.sync
        )  # object store: the commit
        if not self.remote:
            if self.sync:
                fsync_dir(self.tmp)
            commit_directory(self.tmp, self.final, overwrite=self.overwrite)
        self.committed = True
        self._lock.close()
        return self.final

    def abort(self) -> None:
        """Remove everything written so far; ``path`` stays as it was (on an object store with
        ``overwrite``, the old checkpoint is already gone)."""
        self._writer.discard()
        if not self.committed:
            fs.remove_tree(self.tmp)
        self._lock.close()


def _check_remote_destination(final: str, *, overwrite: bool, sources: tuple[str, ...]) -> None:
    """An object-store destination: never inside or around a source; replaced only when it is a
    committed checkpoint (the manifest is there) and ``overwrite`` asks for it."""

    from mfsdp_ckpt.objstore import check_bucket

    check_bucket(final)  # else every upload fails, slowly, after retries
    exists = fs.exists(final)
    if exists and not overwrite:
        raise CheckpointExistsError(f"{final}: already exists (use --overwrite / overwrite=True to replace it)")
    for src in sources:
        if src == final or src.startswith(final + "/"):
            raise CheckpointError(f"{final}: contains the source {src}; replacing it would delete the source")
        if final.startswith(src + "/"):
            raise CheckpointError(f"{final}: lies inside the source {src}; write it elsewhere")
    if not exists:
        return
    if not fs.isfile(fs.join(final, MANIFEST_NAME)):
        raise CheckpointError(f"{final}: is not a committed checkpoint; refusing to replace it")
