"""Chunk-at-a-time writes of canonical checkpoints for the offline tools: :class:`CheckpointBuilder`
appends chunks to data files as they come and commits the directory (``.metadata``, then
``mfsdp.json``, then one rename) only when every key is covered exactly once. The files are the
stock DCP format, so PyTorch's own readers load them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

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

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.checksum import chunk_id, payload_crc32c
from mfsdp_ckpt.format.manifest import completed
from mfsdp_ckpt.format.names import METADATA_NAME, dcp_data_file, is_dcp_data_file
from mfsdp_ckpt.read.chunks import (
    coverage_faults,
)
from mfsdp_ckpt.read.reader import compact
from mfsdp_ckpt.read.records import without_zip_crc
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.write_errors import RecordingStream, reporting
from mfsdp_ckpt.storage.writeback import WritebackStream
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_ckpt.write.manifest import write_manifest

__all__ = ["CheckpointBuilder", "ChunkFileWriter", "ChunkRecord", "data_file_name"]


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


def data_file_name(file: int | str) -> str:
    """The name of data file ``file``: ``__{file}_0.distcp`` for an index (the file of writer
    rank ``file``, as DCP names it), or ``file`` itself, a name of DCP's form
    ``__<rank>_<n>.distcp`` (``__0_3.distcp``: the fourth file of a one-process writer)."""
    if isinstance(file, int):
        return dcp_data_file(file)
    if not is_dcp_data_file(file):
        raise CheckpointError(f"data file name {file!r}: expected {dcp_data_file('<rank>', '<n>')}")
    return file


class ChunkFileWriter:
    """Appends chunks to data files in ``directory`` (``file``: an index or a name, see
    :func:`data_file_name`) and returns their records. One writer per file: two writers (threads,
    processes) must not share a file."""

    def __init__(self, directory: str, *, sync: bool = True) -> None:
        self.directory = directory
        self.sync = sync
        self._place = destination_for(directory)  # what makes a file durable there
        self._files: dict[int | str, RecordingStream] = {}
        self._index: dict[str, int | str] = {}  # file name -> the file as the caller names it
        self.bytes_written = 0

    def _append(self, file: int | str, payload: torch.Tensor | bytes) -> tuple[str, int, int]:
        name = data_file_name(file)
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
        file: int | str,
        crc32c: int | None = None,
    ) -> ChunkRecord:
        """Append ``chunk`` (the box of ``key`` at ``offsets`` of a ``shape`` tensor) to data file
        ``file``. ``crc32c``: the chunk's :func:`~mfsdp_ckpt.sharded.planner.payload_crc32c`, if the
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
        :func:`~mfsdp_ckpt.storage.writeback.start_writeback`; a hint, nothing if the file is closed)."""
        f = self._files.get(self._index.get(record.file, -1))
        try:
            fd = f.fileno() if f is not None else -1
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return
        if fd >= 0:
            self._place.start_writeback(fd, record.offset, record.length)

    def write_object(self, key: str, value: Any, file: int | str) -> ChunkRecord:
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

    def close_file(self, file: int | str) -> None:
        """Finish data file ``file`` (a writer that is done with a file closes it, so that the
        number of open files stays small whatever the number of target ranks)."""
        f = self._files.pop(file, None)
        if f is None:
            return
        with reporting(f.path, [f]):
            try:
                f.flush()
                if self.sync:
                    self._place.sync_file(f)
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

    ``file=i`` puts a chunk in the data file ``__{i}_0.distcp`` (``file="__0_3.distcp"``: that
    file; see :func:`data_file_name`); choose it per chunk so that each future reader rank reads
    one contiguous file. Other processes may write files into
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
        self.overwrite = overwrite
        self.sync = sync
        self.manifest = dict(manifest)
        self.destination = destination_for(self.final)
        sources = tuple(fs.normalize(src) for src in sources)
        self.tmp = self.destination.open(overwrite=overwrite, sources=sources, sync=sync)
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
        for rec in records:  # names interned: .metadata pickles the same whichever process wrote a chunk
            rec = dataclasses.replace(rec, key=sys.intern(rec.key), file=sys.intern(rec.file))
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
        file: int | str = 0,
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

    def add_tensor(
        self, key: str, tensor: torch.Tensor, *, file: int | str = 0, crc32c: int | None = None
    ) -> ChunkRecord:
        """Append the whole tensor ``key`` as one chunk; returns where it went."""
        return self.add_chunk(key, tensor, (0,) * tensor.dim(), tensor.shape, file=file, crc32c=crc32c)

    def start_writeback(self, record: ChunkRecord) -> None:
        """Start writing ``record``'s bytes to disk now (a local file written with ``sync``; see
        :mod:`mfsdp_ckpt.storage.writeback`), so the fsync at :meth:`commit` waits for less. May be called
        from another thread than the one appending, e.g. after handing the next append on."""
        if self.sync:
            self._writer.start_writeback(record)

    def add_object(self, key: str, value: Any, *, file: int | str = 0) -> None:
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
        manifest = completed(self.manifest, save_id, self._chunks)
        self.destination.commit(lambda: write_manifest(self.tmp, manifest, sync=self.sync))
        self.committed = True
        self.destination.close()
        return self.final

    def abort(self) -> None:
        """Remove everything written so far; ``path`` stays as it was (on an object store with
        ``overwrite``, the old checkpoint is already gone)."""
        self._writer.discard()
        if not self.committed:
            self.destination.abort()
        self.destination.close()
