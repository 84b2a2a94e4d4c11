"""The values of ``.metadata``, checked once after the safe unpickle (:mod:`mfsdp_ckpt.format.safety`).

The unpickler admits only DCP's metadata classes and plain containers, but a hostile or damaged
file can still give them any values: negative offsets, strings where sizes belong, a missing
``relative_path``, a tensor of 2⁴⁰ elements stored in a hundred bytes. Two layers:

- :func:`checked_metadata`: the structure, for the whole file. Every object has the type DCP
  gives it; every offset, size and length is a non-negative integer within bounds; chunks have
  the tensor's number of dimensions; every ``relative_path`` names a file inside the checkpoint;
  no two stored chunks share bytes of a file. Violations raise one
  :class:`~mfsdp_ckpt.errors.CorruptCheckpointError` naming the file, key and field: after this,
  readers use the values without checking their types again.
- :func:`entry_faults`: the consistency of one entry, reported per key so that one damaged entry
  does not hide the others (``verify`` lists them all; readers refuse the entries they need).
  A tensor's chunks cover it exactly once, each has its stored data and each stored chunk is in
  the chunk list, and each chunk's elements fit in its stored bytes; an object is stored once.

With both, and the chunk's byte range checked against its file's size before reading, nothing a
reader allocates can exceed the bytes the checkpoint actually holds.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Iterable, Sequence

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

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.names import METADATA_NAME, member_name_problem, shown
from mfsdp_ckpt.read.chunks import Fault, coverage_faults

__all__ = [
    "MAX_NDIM",
    "MAX_ELEMENTS",
    "checked_metadata",
    "stored_by_key",
    "entry_faults",
    "orphan_faults",
    "chunk_nbytes",
]

MAX_NDIM = 64  # torch's own limit on dimensions
MAX_ELEMENTS = 2**62  # more elements than any file holds
_MISSING = object()

Stored = Sequence[tuple[MetadataIndex, _StorageInfo]]


class _Bad(Exception):
    """One structural problem: ``where`` (key / field) and what."""


def _field(obj: Any, name: str) -> Any:
    """An attribute as the unpickled object holds it (a hostile pickle may leave one out)."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise _Bad(f"{name}: missing")
    return value


def _count(value: Any, what: str, limit: int = MAX_ELEMENTS) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise _Bad(f"{what}: {shown(value)} is not an integer in [0, {limit}]")
    return value


def _dims(value: Any, what: str, ndim: int | None = None) -> tuple[int, ...]:
    """A ``torch.Size`` (as DCP writes every size and offset) of bounded non-negative ints;
    ``ndim`` when given must match."""
    if not isinstance(value, torch.Size):
        raise _Bad(f"{what}: expected a torch.Size, got {type(value).__name__}")
    if len(value) > MAX_NDIM:
        raise _Bad(f"{what}: {len(value)} dimensions (at most {MAX_NDIM})")
    dims = tuple(_count(v, f"{what}[{i}]") for i, v in enumerate(value))
    if ndim is not None and len(dims) != ndim:
        raise _Bad(f"{what}: {len(dims)} dimensions for a tensor of {ndim}")
    if _elements(dims) > MAX_ELEMENTS:
        raise _Bad(f"{what}: more than {MAX_ELEMENTS} elements")
    return dims


def _elements(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
        if n > MAX_ELEMENTS:
            return MAX_ELEMENTS + 1
    return n


def _check_tensor(md: TensorStorageMetadata) -> None:
    props = _field(md, "properties")
    if not isinstance(props, TensorProperties):
        raise _Bad(f"properties: expected TensorProperties, got {type(props).__name__}")
    dtype = _field(props, "dtype")
    if not isinstance(dtype, torch.dtype):
        raise _Bad(f"properties.dtype: expected a torch.dtype, got {type(dtype).__name__}")
    size = _dims(_field(md, "size"), "size")
    chunks = _field(md, "chunks")
    if not isinstance(chunks, list):
        raise _Bad(f"chunks: expected a list, got {type(chunks).__name__}")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _Bad(f"chunks[{i}]: expected ChunkStorageMetadata, got {type(chunk).__name__}")
        _dims(_field(chunk, "offsets"), f"chunks[{i}].offsets", len(size))
        _dims(_field(chunk, "sizes"), f"chunks[{i}].sizes", len(size))


def _check_index(index: Any) -> None:
    if not isinstance(index, MetadataIndex):
        raise _Bad(f"expected a MetadataIndex, got {type(index).__name__}")
    fqn = _field(index, "fqn")
    if not isinstance(fqn, str) or not fqn.isprintable():
        raise _Bad(f"fqn: {shown(fqn)} is not a printable string")
    offset = _field(index, "offset")
    if offset is not None:
        _dims(offset, "offset")
    if not isinstance(index.index, (int, type(None))):
        raise _Bad(f"index: expected an integer, got {type(index.index).__name__}")


def _check_info(info: Any) -> None:
    if not isinstance(info, _StorageInfo):
        raise _Bad(f"expected a _StorageInfo, got {type(info).__name__}")
    problem = member_name_problem(_field(info, "relative_path"))
    if problem is not None:
        raise _Bad(f"relative_path: {problem}")
    _count(_field(info, "offset"), "offset", 2**63 - 1)
    _count(_field(info, "length"), "length", 2**63 - 1)
    transforms = getattr(info, "transform_descriptors", None)
    if transforms is not None and (
        not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) and t.isprintable() for t in transforms)
    ):
        raise _Bad("transform_descriptors: expected a list of strings")


def _check_storage_meta(meta: Any) -> None:
    if meta is None:
        return
    if not isinstance(meta, StorageMeta):
        raise _Bad(f"storage_meta: expected StorageMeta, got {type(meta).__name__}")
    save_id = getattr(meta, "save_id", None)
    if save_id is not None and (not isinstance(save_id, str) or not save_id.isprintable()):
        raise _Bad(f"storage_meta.save_id: {shown(save_id)} is not a printable string")


def _where(key: Any, offset: Any = None) -> str:
    return f"key '{shown(key)}'" + (f" chunk at {list(offset)}" if offset is not None else "")


def checked_metadata(obj: Any, source: str) -> Metadata:
    """``obj`` (what the safe unpickler returned from ``source``) if its structure is sound (see
    the module docstring); one :class:`CorruptCheckpointError` naming ``source``, the key and the
    field otherwise."""
    where = ""
    try:
        if not isinstance(obj, Metadata):
            raise _Bad(f"does not hold DCP metadata (a {type(obj).__name__})")
        state = _field(obj, "state_dict_metadata")
        if not isinstance(state, dict):
            raise _Bad(f"state_dict_metadata: expected a dict, got {type(state).__name__}")
        for key, md in state.items():
            where = f"key '{shown(key)}': "
            if not isinstance(key, str) or not key.isprintable():
                raise _Bad("a key must be a printable string")
            if isinstance(md, TensorStorageMetadata):
                _check_tensor(md)
            elif not isinstance(md, BytesStorageMetadata):
                raise _Bad(f"expected tensor or bytes storage metadata, got {type(md).__name__}")
        where = ""
        storage = _field(obj, "storage_data")
        if not isinstance(storage, dict):
            raise _Bad(f"storage_data: expected a dict, got {type(storage).__name__}")
        for index, info in storage.items():
            where = "storage_data: "
            _check_index(index)
            where = f"storage_data {_where(index.fqn, index.offset)}: "
            _check_info(info)
        where = ""
        _check_storage_meta(_field(obj, "storage_meta"))
        _check_disjoint(storage)
    except _Bad as e:
        raise CorruptCheckpointError(f"{source}: {where}{e}") from None
    return obj


def _check_disjoint(storage: dict[MetadataIndex, _StorageInfo]) -> None:
    """No two stored chunks share a byte of one file (so the chunks of a checkpoint never add up
    to more bytes than its files hold)."""
    by_file: dict[str, list[tuple[int, int, MetadataIndex]]] = defaultdict(list)
    for index, info in storage.items():
        if info.length:
            by_file[os.path.normpath(info.relative_path)].append((info.offset, info.offset + info.length, index))
    for name, ranges in by_file.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
            if start_b < end_a:
                raise _Bad(
                    f"storage_data {_where(b.fqn, b.offset)} shares bytes of {shown(name)} with {_where(a.fqn, a.offset)}"
                )


def stored_by_key(metadata: Metadata) -> dict[str, list[tuple[MetadataIndex, _StorageInfo]]]:
    """Each key's stored chunks (``storage_data`` grouped by key)."""
    out: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        out[index.fqn].append((index, info))
    return dict(out)


def chunk_nbytes(dtype: torch.dtype, sizes: Iterable[int]) -> int:
    """Bytes of a chunk's elements."""
    return math.prod(sizes) * dtype.itemsize


def entry_faults(
    key: str, md: Any, stored: Stored, source: str = METADATA_NAME, *, check_coverage: bool = True
) -> list[Fault]:
    """What is wrong with entry ``key`` of checked metadata (``md`` its storage metadata,
    ``stored`` its stored chunks), in this order: chunks not covering the tensor exactly once
    (:func:`~mfsdp_ckpt.read.chunks.coverage_faults`, file None), then, in ``source``: stored chunks
    the chunk list lacks, listed chunks with nothing stored, chunks whose elements do not fit in
    their stored bytes; for an object, anything but one stored record. Empty: sound.
    ``check_coverage=False``: the caller already checked the coverage (``load`` does while it plans)."""
    if isinstance(md, BytesStorageMetadata):
        records = [index for index, _ in stored if index.offset is None]
        faults = [
            Fault(source, key, tuple(index.offset), "stored as a tensor chunk of an object entry")
            for index, _ in stored
            if index.offset is not None
        ]
        if len(records) != 1:
            faults.append(Fault(source, key, None, "nothing stored" if not records else f"stored {len(records)} times"))
        return faults
    faults = coverage_faults(key, md) if check_coverage else []
    listed = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
    offsets = set()
    for index, info in stored:
        if index.offset is None or tuple(index.offset) not in listed:
            at = tuple(index.offset) if index.offset is not None else None
            faults.append(Fault(source, key, at, "stored, but not in the metadata's chunk list"))
            continue
        offsets.add(tuple(index.offset))
        need = chunk_nbytes(md.properties.dtype, listed[tuple(index.offset)])
        if need > info.length:
            faults.append(
                Fault(
                    source,
                    key,
                    tuple(index.offset),
                    f"its {need} bytes of {str(md.properties.dtype).replace('torch.', '')} elements "
                    f"do not fit in its {info.length} stored bytes",
                )
            )
    for off in listed:
        if off not in offsets:
            faults.append(Fault(source, key, off, "listed in the metadata, but not stored"))
    return faults


def orphan_faults(metadata: Metadata, source: str = METADATA_NAME) -> list[Fault]:
    """Stored chunks of keys the metadata does not list at all."""
    return [
        Fault(
            source,
            index.fqn,
            tuple(index.offset) if index.offset is not None else None,
            "stored, but the metadata lists no such key",
        )
        for index in metadata.storage_data
        if index.fqn not in metadata.state_dict_metadata
    ]
