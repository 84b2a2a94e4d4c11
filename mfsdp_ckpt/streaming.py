"""Whole-entry reads and chunk-at-a-time writes of canonical checkpoints, in one process.

Offline tools (``reshard``, the HF bridge, ``convert``) hold one tensor at a time, never the whole
checkpoint: :class:`CheckpointReader` returns one entry, assembled from its chunks and verified
against the manifest; :class:`CheckpointBuilder` appends chunks to data files as they come and
commits the directory (``.metadata``, then ``mfsdp.json``, then one rename) only when every key is
covered exactly once. The files are the stock DCP format, so PyTorch's own readers load them.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import time
import uuid
from typing import Any

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

from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .manifest import FORMAT, FORMAT_VERSION, write_manifest
from .planner import chunk_id, payload_crc32c
from .storage import ChunkFault, commit_directory, fsync_dir, read_chunk

__all__ = ["CheckpointReader", "CheckpointBuilder", "compact"]


class CheckpointReader:
    """One whole entry (tensor or object) at a time from a checkpoint, every chunk verified.

    Peak memory of :meth:`read` is the tensor plus its largest chunk. Use as a context manager
    (it keeps the data files open)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from .inspect import open_checkpoint

        self.directory, self.manifest, self.metadata, _ = open_checkpoint(os.fspath(path))
        self._chunks_by_key: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
        for index, info in (self.metadata.storage_data or {}).items():
            self._chunks_by_key.setdefault(index.fqn, []).append((index, info))
        self._files: dict[str, io.BufferedReader] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def keys(self) -> list[str]:
        return sorted(self.metadata.state_dict_metadata)

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata[key], TensorStorageMetadata)

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def _file(self, relative_path: str, key: str) -> io.BufferedReader:
        f = self._files.get(relative_path)
        if f is None:
            path = os.path.join(self.directory, relative_path)
            try:
                f = open(path, "rb")
            except OSError as e:
                raise CorruptCheckpointError(f"{path}: cannot open ({e.strerror}), needed for key '{key}'") from None
            self._files[relative_path] = f
        return f

    def _payload(self, index: MetadataIndex, info: _StorageInfo) -> torch.Tensor | bytes:
        f = self._file(info.relative_path, index.fqn)
        try:
            return read_chunk(f, info, index, self.manifest["chunks"] if self.manifest else None)
        except ChunkFault as e:
            at = f" chunk at {list(index.offset)}" if index.offset is not None else ""
            raise CorruptCheckpointError(f"{os.path.join(self.directory, info.relative_path)}: key '{index.fqn}'{at}: {e}") from None

    def read(self, key: str) -> Any:
        """The entry ``key``: a full tensor, or the object (unpickled with ``weights_only``)."""
        md = self.metadata.state_dict_metadata.get(key)
        if md is None:
            raise CheckpointError(f"{self.directory}: no key '{key}'")
        chunks = self._chunks_by_key.get(key, [])
        if not isinstance(md, TensorStorageMetadata):
            if len(chunks) != 1:
                raise CorruptCheckpointError(f"{self.directory}: key '{key}' has {len(chunks)} stored objects, expected 1")
            data = self._payload(*chunks[0])
            try:
                return torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:
                raise CorruptCheckpointError(f"{self.directory}: key '{key}': object not loadable with weights_only ({type(e).__name__})") from None
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = 0
        for index, info in sorted(chunks, key=lambda c: (c[1].relative_path, c[1].offset)):
            piece = self._payload(index, info)
            assert isinstance(piece, torch.Tensor)
            region = out
            for dim, (o, s) in enumerate(zip(index.offset, piece.shape)):
                region = region.narrow(dim, o, s)
            if piece.dtype != out.dtype or region.shape != piece.shape:
                raise CorruptCheckpointError(
                    f"{self.directory}: key '{key}' chunk at {list(index.offset)}: holds {piece.dtype} {tuple(piece.shape)}, "
                    f"which does not fit {md.properties.dtype} {tuple(md.size)}"
                )
            region.copy_(piece)
            covered += piece.numel()
            del piece
        if covered != out.numel():
            raise CorruptCheckpointError(f"{self.directory}: key '{key}': chunks cover {covered} of {out.numel()} elements")
        return out


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


class CheckpointBuilder:
    """Builds a committed checkpoint from chunks appended one at a time, in one process.

    ``files[i]`` is the data file ``__{i}_0.distcp``; choose ``file`` per chunk so that each
    future reader rank reads one contiguous file. Nothing is visible at ``path`` until
    :meth:`commit`; on an exception inside ``with`` (or :meth:`abort`) the temporary directory is
    removed and ``path`` is untouched."""

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any], *, overwrite: bool = False, sync: bool = True) -> None:
        self.final = os.path.abspath(os.fspath(path))
        if os.path.exists(self.final) and not overwrite:
            raise CheckpointExistsError(f"{self.final}: already exists (use --overwrite / overwrite=True to replace it)")
        self.overwrite = overwrite
        self.sync = sync
        self.manifest = dict(manifest)
        parent = os.path.dirname(self.final)
        os.makedirs(parent, exist_ok=True)
        self.tmp = os.path.join(parent, f".{os.path.basename(self.final)}.partial-{uuid.uuid4().hex[:12]}")
        os.makedirs(self.tmp)
        self._files: dict[int, io.BufferedWriter] = {}
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._objects: set[str] = set()
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._chunks: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self.committed = False

    def __enter__(self) -> "CheckpointBuilder":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None or not self.committed:
            self.abort()

    def _stream(self, file: int) -> tuple[str, io.BufferedWriter]:
        name = f"__{file}_0.distcp"
        f = self._files.get(file)
        if f is None:
            f = open(os.path.join(self.tmp, name), "wb")
            self._files[file] = f
        return name, f

    def _record(self, index: MetadataIndex, file: int, payload: torch.Tensor | bytes) -> None:
        name, f = self._stream(file)
        offset = f.tell()
        if isinstance(payload, bytes):
            f.write(payload)
        else:
            torch.save(payload, f)
        length = f.tell() - offset
        self.bytes_written += length
        self._storage[index] = _StorageInfo(name, offset, length)
        self._chunks[chunk_id(index)] = {"file": name, "offset": offset, "length": length, "crc32c": payload_crc32c(payload)}

    def add_chunk(self, key: str, chunk: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...] | torch.Size, *, file: int = 0) -> None:
        """Append the box of ``key`` (global ``shape``) at ``offsets`` holding ``chunk``."""
        if key in self._objects:
            raise CheckpointError(f"key '{key}': already written as an object")
        shape = torch.Size(shape)
        md = self._tensors.get(key)
        if md is None:
            md = TensorStorageMetadata(TensorProperties(dtype=chunk.dtype), shape, [])
            self._tensors[key] = md
        elif md.size != shape or md.properties.dtype != chunk.dtype:
            raise CheckpointError(f"key '{key}': chunk {chunk.dtype} of a {tuple(shape)} tensor, earlier chunks said {md.properties.dtype} {tuple(md.size)}")
        offsets = torch.Size(offsets)
        if len(offsets) != len(shape) or chunk.dim() != len(shape) or any(
            o < 0 or o + s > d for o, s, d in zip(offsets, chunk.shape, shape)
        ):
            raise CheckpointError(f"key '{key}': chunk {tuple(chunk.shape)} at {list(offsets)} lies outside {tuple(shape)}")
        index = MetadataIndex(key, offsets)
        if index in self._storage:
            raise CheckpointError(f"key '{key}': a chunk at {list(offsets)} was already written")
        self._record(index, file, compact(chunk.detach().cpu()))
        md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk.shape)))

    def add_tensor(self, key: str, tensor: torch.Tensor, *, file: int = 0) -> None:
        """Append the whole tensor ``key`` as one chunk."""
        self.add_chunk(key, tensor, (0,) * tensor.dim(), tensor.shape, file=file)

    def add_object(self, key: str, value: Any, *, file: int = 0) -> None:
        """Append a plain object (saved with ``torch.save``; loaded back with ``weights_only``)."""
        if key in self._tensors or key in self._objects:
            raise CheckpointError(f"key '{key}': already written")
        buf = io.BytesIO()
        torch.save(value, buf)
        self._objects.add(key)
        self._record(MetadataIndex(key), file, buf.getvalue())

    def _check_coverage(self) -> None:
        from .inspect import _coverage_faults

        bad = []
        for key, md in self._tensors.items():
            if _coverage_faults(key, md):
                covered = sum(math.prod(c.sizes) for c in md.chunks)
                bad.append(f"{key} ({covered} of {math.prod(md.size)} elements, or overlapping chunks)")
        if bad:
            raise CheckpointError(f"{self.final}: not every tensor is covered exactly once: {', '.join(sorted(bad))}")

    def commit(self) -> str:
        """Check coverage, write ``.metadata`` and ``mfsdp.json``, and make the directory visible."""
        self._check_coverage()
        for f in self._files.values():
            f.flush()
            if self.sync:
                os.fsync(f.fileno())
            f.close()
        self._files = {}
        save_id = str(uuid.uuid4())
        state_md: dict[str, Any] = dict(self._tensors)
        state_md.update((k, BytesStorageMetadata()) for k in self._objects)
        metadata = Metadata(
            state_dict_metadata=state_md,
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=self.final, save_id=save_id),
            version=CURRENT_DCP_VERSION,
        )
        with open(os.path.join(self.tmp, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
            if self.sync:
                os.fsync(f.fileno())
        manifest = dict(self.manifest)
        manifest.update(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            save_id=save_id,
            created_unix=time.time(),
            chunks=self._chunks,
            total_bytes=sum(c["length"] for c in self._chunks.values()),
        )
        write_manifest(self.tmp, manifest, sync=self.sync)
        if self.sync:
            fsync_dir(self.tmp)
        commit_directory(self.tmp, self.final, overwrite=self.overwrite)
        self.committed = True
        return self.final

    def abort(self) -> None:
        """Remove everything written so far; ``path`` stays as it was."""
        for f in self._files.values():
            f.close()
        self._files = {}
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
