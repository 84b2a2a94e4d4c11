"""The stock ``.metadata`` of a checkpoint, read safely, and its agreement with the index.

Our readers of a save's checkpoint never need ``.metadata`` (:mod:`mfsdp_ckpt.read.indexed`); it
is written for stock PyTorch tools. ``verify`` still reads it here and checks that it says what
the index says: the same keys, dtypes, shapes and chunks, each chunk at the same place, and that
every rank's record tables list exactly the chunks the index gives that rank.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.names import METADATA_NAME
from mfsdp_ckpt.format.safety import safe_load_metadata
from mfsdp_ckpt.read.chunks import Fault
from mfsdp_ckpt.read.indexed import IndexedCheckpoint
from mfsdp_ckpt.read.manifest import metadata_checksum_problem
from mfsdp_ckpt.read.metadata_check import checked_metadata
from mfsdp_ckpt.storage import fs

__all__ = ["read_stock_metadata", "index_faults"]


def read_stock_metadata(directory: str, manifest: dict[str, Any] | None) -> Metadata:
    """``.metadata`` through the restricted unpickler, checked against the manifest's checksum of
    it and :func:`~mfsdp_ckpt.read.metadata_check.checked_metadata`; one
    :class:`CorruptCheckpointError` naming the file otherwise."""
    path = fs.join(directory, METADATA_NAME)
    try:
        data = fs.read_member(directory, METADATA_NAME)
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read DCP metadata ({e.strerror or e})") from None
    metadata = safe_load_metadata(data, path)
    problem = metadata_checksum_problem(manifest, data)
    if problem is not None:
        raise CorruptCheckpointError(f"{path}: {problem}")
    return checked_metadata(metadata, path)


def _describe(md: Any) -> Any:
    if isinstance(md, BytesStorageMetadata):
        return "object"
    assert isinstance(md, TensorStorageMetadata)
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
    return (str(md.properties.dtype).replace("torch.", ""), tuple(md.size), chunks)


def index_faults(indexed: IndexedCheckpoint, stock: Metadata) -> list[Fault]:
    """Where ``.metadata`` and the index disagree (empty: they agree)."""
    faults: list[Fault] = []
    ours = indexed.metadata()
    keys = set(indexed.catalog.keys)
    theirs = set(stock.state_dict_metadata)
    faults += [Fault(METADATA_NAME, k, None, "in the index but not in .metadata") for k in sorted(keys - theirs)]
    faults += [Fault(METADATA_NAME, k, None, "in .metadata but not in the index") for k in sorted(theirs - keys)]
    for key in sorted(keys & theirs):
        a, b = _describe(ours.state_dict_metadata[key]), _describe(stock.state_dict_metadata[key])
        if a != b:
            faults.append(Fault(METADATA_NAME, key, None, "its dtype, shape or chunks differ from the index's"))
    for index, info in stock.storage_data.items():
        offset = tuple(index.offset) if index.offset is not None else None
        at = indexed.place(MetadataIndex(index.fqn, index.offset)) if index.fqn in keys else None
        if at is None:
            faults.append(
                Fault(METADATA_NAME, index.fqn, offset, "stored in .metadata, but no such chunk in the index")
            )
        elif (at[0], at[1].offset, at[1].length) != (info.relative_path, info.offset, info.length):
            faults.append(
                Fault(
                    METADATA_NAME,
                    index.fqn,
                    offset,
                    f"the record table places it at {at[0]} bytes {at[1].offset}+{at[1].length}, "
                    f".metadata at {info.relative_path} bytes {info.offset}+{info.length}",
                )
            )
    given: dict[int, int] = {}
    for key in keys:
        for rank, _ in indexed.chunks_of(key).values():
            given[rank] = given.get(rank, 0) + 1
    for rank in sorted(set(given) | {f.rank for f in indexed.files}):
        rows = len(indexed.table(rank))
        if rows != given.get(rank, 0):
            names = ", ".join(f.name for f in indexed.files if f.rank == rank) or f"rank {rank}"
            faults.append(
                Fault(
                    names,
                    "-",
                    None,
                    f"the record tables list {rows} chunks, the index gives rank {rank} {given.get(rank, 0)}",
                )
            )
    return faults
