"""A saved checkpoint read through its index: DCP metadata, chunk places and checksums derived on
demand from ``mfsdp.json``'s index and the data files' record tables, never from ``.metadata``.

The index names the global plan, the mesh and the key table (:mod:`mfsdp_ckpt.format.catalog`),
from which every key's chunks and the rank that wrote each follow; a rank's record tables
(:mod:`mfsdp_ckpt.format.record_table`, one at the end of each of its files) give each chunk's
bytes and crc32c. Everything is computed when first asked for: an entry's chunk list is a
:class:`DerivedChunks` that a load narrows to the elements its rank holds (:func:`narrowed`;
a binary search on the layout, so a rank of a 1,024-rank job derives the few chunks it reads,
not all 1,024 of each key), a chunk's place is found the same way, and a load reads the record
tables of the ranks it reads from. Nothing proportional to ranks × tensors is built unless a
caller walks every chunk (``verify``, ``inspect``).

The mappings here stand in for DCP's dicts (``state_dict_metadata``, ``storage_data``, the
manifest's chunk table), so every reader works on both kinds of checkpoint unchanged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import CatalogError, CorruptCheckpointError, OutsideCheckpointError
from mfsdp_ckpt.format.boxes import Box
from mfsdp_ckpt.format.catalog import Catalog
from mfsdp_ckpt.format.checksum import chunk_id
from mfsdp_ckpt.format.names import MANIFEST_NAME
from mfsdp_ckpt.format.record_table import DataFile, Record, chunk_hash, decode_table, table_size
from mfsdp_ckpt.storage import fs
from mfsdp_core.dtypes import dtype_by_name
from mfsdp_core.plan import ModelPlan

__all__ = ["DerivedChunks", "IndexedCheckpoint", "derived", "has_index", "narrowed"]

_MAX_NDIM = 64
_MAX_ELEMENTS = 2**62


def has_index(manifest: dict[str, Any] | None) -> bool:
    """Whether a manifest holds a save's index (else it lists every chunk, or there is none)."""
    return bool(manifest) and "index" in manifest


class IndexedCheckpoint:
    """The chunks of a checkpoint with an index (see the module docstring). Thread-safe: a load's
    reader threads look chunks up concurrently."""

    def __init__(self, directory: str, manifest: dict[str, Any], file_name: Callable[[str], str] | None = None) -> None:
        self.directory = directory
        # how readers name a data file (a referencing checkpoint names its base's files its own way)
        self.file_name = file_name or (lambda name: name)
        where = f"{fs.join(directory, MANIFEST_NAME)}: field 'index'"
        try:
            plan = ModelPlan.from_dict(manifest["writer"]["plan"])
            self.catalog = Catalog.from_dict(manifest["index"], plan)
        except (CatalogError, ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
        for key, info in self.catalog.keys.items():
            shape = info.shape or ()
            if len(shape) > _MAX_NDIM or math.prod(shape) > _MAX_ELEMENTS:
                raise CorruptCheckpointError(f"{where}: key '{key}': shape {list(shape)} is out of bounds")
            if isinstance(info.where, int) and not 0 <= info.where < self.catalog.mesh.world:
                raise CorruptCheckpointError(f"{where}: key '{key}': rank {info.where} is not a rank of the job")
            if not isinstance(info.where, int):
                try:  # its parameter, plane and element count: what a reader of any part relies on
                    self.catalog.locate(key)
                except CatalogError as e:
                    raise CorruptCheckpointError(f"{where}: {e}") from None
        self.files = [DataFile.from_list(v) for v in manifest["index"]["files"]]
        self._files_of: dict[int, list[DataFile]] = {}
        for f in self.files:
            self._files_of.setdefault(f.rank, []).append(f)
        self.save_id = manifest.get("save_id")
        self._lock = threading.RLock()
        self._tables: dict[int, dict[int, tuple[str, Record]]] = {}
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, Box]]] = {}
        self._md: dict[str, Any] = {}
        self._within: dict[tuple[str, int, int], list[tuple[int, Box]]] = {}

    # ---- chunks ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return sorted(self.catalog.keys)

    def is_bytes(self, key: str) -> bool:
        return self.catalog.keys[key].dtype is None

    def chunks_of(self, key: str) -> dict[tuple[int, ...], tuple[int, Box]]:
        """Offsets -> (writing rank, box) of every chunk of ``key`` (KeyError: no such key)."""
        with self._lock:
            found = self._chunks.get(key)
            if found is None:
                if key not in self.catalog.keys:
                    raise KeyError(key)
                try:
                    found = {box.offsets: (r, box) for r, box in self.catalog.chunks(key)}
                except CatalogError as e:
                    raise CorruptCheckpointError(
                        f"{fs.join(self.directory, MANIFEST_NAME)}: field 'index': {e}"
                    ) from None
                self._chunks[key] = found
            return found

    def chunks_within(self, key: str, lo: int, hi: int) -> list[tuple[int, Box]]:
        """(writing rank, box) of the chunks of ``key`` overlapping its elements ``[lo, hi)``
        (row-major), in flat order, without deriving the others (KeyError: no such key). Kept per
        range: a load's entry check and its planner ask for the same one."""
        with self._lock:
            found = self._within.get((key, lo, hi))
        if found is not None:
            return found
        if key not in self.catalog.keys:
            raise KeyError(key)
        try:
            found = self.catalog.chunks(key, lo, hi)
        except CatalogError as e:
            raise CorruptCheckpointError(f"{fs.join(self.directory, MANIFEST_NAME)}: field 'index': {e}") from None
        with self._lock:
            self._within[(key, lo, hi)] = found
        return found

    def chunk_at(self, key: str, offsets: tuple[int, ...]) -> tuple[int, Box] | None:
        """(writing rank, box) of the chunk of ``key`` starting at ``offsets``, or None."""
        info = self.catalog.keys.get(key)
        if info is None:
            raise KeyError(key)
        if isinstance(info.where, int):  # an object or a tensor written whole: one chunk
            return self.chunks_of(key).get(offsets)
        shape = tuple(info.shape or ())
        if len(offsets) != len(shape) or any(not 0 <= o < d for o, d in zip(offsets, shape)):
            return None
        flat = 0
        for o, d in zip(offsets, shape):
            flat = flat * d + o
        for rank, box in self.chunks_within(key, flat, flat + 1):
            if box.offsets == offsets:
                return rank, box
        return None

    def index_of(self, key: str, box: Box) -> MetadataIndex:
        return MetadataIndex(key) if self.is_bytes(key) else MetadataIndex(key, torch.Size(box.offsets))

    def table(self, rank: int) -> dict[int, tuple[str, Record]]:
        """Chunk hash -> (file, record) over every data file ``rank`` wrote (read once)."""
        with self._lock:
            found = self._tables.get(rank)
            if found is not None:
                return found
            found = {}
            for f in self._files_of.get(rank, []):
                for h, rec in self._read_table(f).items():
                    found[h] = (f.name, rec)
            self._tables[rank] = found
            return found

    def _read_table(self, f: DataFile) -> dict[int, Record]:
        path = fs.join(self.directory, f.name)
        size = table_size(f.rows)
        try:
            with fs.open_member(self.directory, f.name) as handle:
                actual = fs.file_size(handle)
                if actual < f.size:
                    raise CorruptCheckpointError(f"{path}: truncated ({actual} bytes, the index says {f.size})")
                if actual != f.size:
                    raise CorruptCheckpointError(
                        f"{path}: {actual} bytes, the index says {f.size} (the file was changed after the save)"
                    )
                if size > actual:
                    raise CorruptCheckpointError(f"{path}: shorter than its record table")
                handle.seek(actual - size)
                data = handle.read(size)
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot read its record table ({e.strerror or e})") from None
        except OutsideCheckpointError as e:
            raise CorruptCheckpointError(f"{path}: {e.reason}") from None
        try:
            table = decode_table(data, f.rows, f.table_crc32c)
        except ValueError as e:
            raise CorruptCheckpointError(f"{path}: {e}") from None
        end, last = f.size - size, 0
        for rec in sorted(table.values(), key=lambda r: r.offset):
            if rec.offset < last or rec.offset + rec.length > end:
                raise CorruptCheckpointError(f"{path}: its record table lists overlapping or out-of-file records")
            last = rec.offset + rec.length
        return table

    def place(self, index: MetadataIndex) -> tuple[str, Record] | None:
        """The file and record of a chunk (None: not a chunk of this checkpoint). A chunk the
        catalog gives a rank whose record tables lack it is a :class:`CorruptCheckpointError`."""
        offsets = tuple(index.offset) if index.offset is not None else ()
        try:
            found = self.chunk_at(index.fqn, offsets)
        except KeyError:
            return None
        if found is None or (index.offset is None) != self.is_bytes(index.fqn):
            return None
        rank, box = found
        cid = chunk_id(self.index_of(index.fqn, box))
        try:
            table = self.table(rank)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}; needed for key '{index.fqn}'") from None
        at = table.get(chunk_hash(cid))
        if at is None:
            names = ", ".join(f.name for f in self._files_of.get(rank, [])) or f"no file of rank {rank}"
            raise CorruptCheckpointError(
                f"{fs.join(self.directory, names)}: key '{index.fqn}'"
                + (f" chunk at {list(index.offset)}" if index.offset is not None else "")
                + ": not in the record table"
            )
        return at

    # ---- DCP metadata -----------------------------------------------------------------------
    def entry(self, key: str) -> Any:
        """The DCP storage metadata of ``key`` (KeyError: no such key)."""
        with self._lock:
            md = self._md.get(key)
            if md is not None:
                return md
            info = self.catalog.keys[key]
            if info.dtype is None:
                md = BytesStorageMetadata()
            else:
                md = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype_by_name(info.dtype)),
                    size=torch.Size(info.shape or ()),
                    chunks=DerivedChunks(self, key),  # type: ignore[arg-type]  # a list when walked
                )
            self._md[key] = md
            return md

    def metadata(self) -> Metadata:
        """DCP metadata whose entries and storage data are computed as they are looked up."""
        return Metadata(
            state_dict_metadata=_Entries(self),
            storage_data=_Storage(self),
            storage_meta=StorageMeta(save_id=self.save_id) if self.save_id else None,
        )

    @property
    def checksums(self) -> "_Checksums":
        """The manifest's chunk table as readers use it: chunk id -> place and crc32c."""
        return _Checksums(self)

    @property
    def stored(self) -> "_Stored":
        """Key -> its stored chunks ``[(MetadataIndex, _StorageInfo)]``."""
        return _Stored(self)

    @property
    def chunk_shapes(self) -> "_Shapes":
        """MetadataIndex -> (dtype, sizes) of every tensor chunk."""
        return _Shapes(self)

    def stored_within(self, key: str, lo: int, hi: int) -> list[tuple[MetadataIndex, _StorageInfo]]:
        """The stored chunks of ``key`` overlapping its elements ``[lo, hi)``: what
        :attr:`stored` gives, for those chunks only."""
        storage = _Storage(self)
        return [(i, storage[i]) for i in (self.index_of(key, box) for _, box in self.chunks_within(key, lo, hi))]

    def all_indices(self) -> Iterator[MetadataIndex]:
        for key in self.keys():
            for _, box in sorted(self.chunks_of(key).values(), key=lambda rb: rb[1].flat_start):
                yield self.index_of(key, box)


class DerivedChunks(Sequence):
    """The chunk list of a tensor entry of an indexed checkpoint: derived from the layout when
    first walked, and by construction covering the tensor exactly once (the layout's pieces
    partition every parameter), so a load skips the coverage check and asks only for the chunks
    it reads (:func:`narrowed`)."""

    def __init__(self, ck: IndexedCheckpoint, key: str) -> None:
        self.ck, self.key = ck, key
        self._list: list[ChunkStorageMetadata] | None = None

    def _all(self) -> list[ChunkStorageMetadata]:
        if self._list is None:
            chunks = sorted(self.ck.chunks_of(self.key).values(), key=lambda rb: rb[1].flat_start)
            self._list = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for _, b in chunks]
        return self._list

    def __getitem__(self, i):  # type: ignore[override]
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self._all())

    def stored_within(self, lo: int, hi: int) -> list[tuple[MetadataIndex, _StorageInfo]]:
        """The stored chunks overlapping elements ``[lo, hi)`` (the chunks :meth:`within` lists)."""
        return self.ck.stored_within(self.key, lo, hi)

    def within(self, lo: int, hi: int) -> list[ChunkStorageMetadata]:
        """The chunks overlapping elements ``[lo, hi)``, in flat order."""
        return [
            ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
            for _, b in self.ck.chunks_within(self.key, lo, hi)
        ]


def narrowed(md: Any, lo: int, hi: int) -> Any:
    """``md`` with only the chunks overlapping elements ``[lo, hi)`` when its chunks are derived
    from an index (what a rank reads of it), else ``md`` itself. Loading those elements needs no
    other chunk."""
    if isinstance(md, TensorStorageMetadata) and isinstance(md.chunks, DerivedChunks):
        return TensorStorageMetadata(md.properties, md.size, md.chunks.within(lo, hi))
    return md


def derived(md: Any) -> bool:
    """Whether ``md``'s chunks come from an index (and so cover the tensor by construction)."""
    return isinstance(md, TensorStorageMetadata) and isinstance(md.chunks, DerivedChunks)


class _Entries(Mapping):
    def __init__(self, ck: IndexedCheckpoint) -> None:
        self.ck = ck

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self.ck.catalog.keys:
            raise KeyError(key)
        return self.ck.entry(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ck.keys())

    def __len__(self) -> int:
        return len(self.ck.catalog.keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.ck.catalog.keys


class _Storage(Mapping):
    def __init__(self, ck: IndexedCheckpoint) -> None:
        self.ck = ck

    def __getitem__(self, index: MetadataIndex) -> _StorageInfo:
        at = self.ck.place(index) if isinstance(index, MetadataIndex) else None
        if at is None:
            raise KeyError(index)
        name, rec = at
        return _StorageInfo(self.ck.file_name(name), rec.offset, rec.length)

    def __iter__(self) -> Iterator[MetadataIndex]:
        return self.ck.all_indices()

    def __len__(self) -> int:
        return sum(len(self.ck.chunks_of(k)) for k in self.ck.keys())


class _Checksums(Mapping):
    """chunk id -> ``{"file", "offset", "length", "crc32c"}``, as the manifest's chunk table."""

    def __init__(self, ck: IndexedCheckpoint) -> None:
        self.ck = ck

    def _index(self, cid: str) -> MetadataIndex | None:
        keys = self.ck.catalog.keys
        if cid in keys and self.ck.is_bytes(cid):
            return MetadataIndex(cid)
        key, sep, offsets = cid.rpartition("@")
        if not sep or key not in keys or self.ck.is_bytes(key):
            return None
        try:
            return MetadataIndex(key, torch.Size(int(o) for o in offsets.split(",")) if offsets else torch.Size())
        except ValueError:
            return None

    def __getitem__(self, cid: str) -> dict[str, Any]:
        index = self._index(cid) if isinstance(cid, str) else None
        at = self.ck.place(index) if index is not None else None
        if at is None:
            raise KeyError(cid)
        name, rec = at
        return {"file": self.ck.file_name(name), "offset": rec.offset, "length": rec.length, "crc32c": rec.crc32c}

    def __iter__(self) -> Iterator[str]:
        return (chunk_id(i) for i in self.ck.all_indices())

    def __len__(self) -> int:
        return len(_Storage(self.ck))


class _Stored(Mapping):
    def __init__(self, ck: IndexedCheckpoint) -> None:
        self.ck = ck

    def __getitem__(self, key: str) -> list[tuple[MetadataIndex, _StorageInfo]]:
        if not isinstance(key, str) or key not in self.ck.catalog.keys:
            raise KeyError(key)
        storage = _Storage(self.ck)
        out = []
        for _, box in sorted(self.ck.chunks_of(key).values(), key=lambda rb: rb[1].flat_start):
            index = self.ck.index_of(key, box)
            out.append((index, storage[index]))
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.ck.keys())

    def __len__(self) -> int:
        return len(self.ck.catalog.keys)


class _Shapes(Mapping):
    def __init__(self, ck: IndexedCheckpoint) -> None:
        self.ck = ck

    def __getitem__(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]]:
        if not isinstance(index, MetadataIndex) or index.offset is None:
            raise KeyError(index)
        try:
            found = self.ck.chunk_at(index.fqn, tuple(index.offset))
        except KeyError:
            raise KeyError(index) from None
        info = self.ck.catalog.keys[index.fqn]
        if found is None or info.dtype is None:
            raise KeyError(index)
        return dtype_by_name(info.dtype), tuple(found[1].sizes)

    def __iter__(self) -> Iterator[MetadataIndex]:
        return (i for i in self.ck.all_indices() if i.offset is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
