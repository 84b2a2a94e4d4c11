"""A :class:`~mfsdp_ckpt.read.reader.CheckpointReader` that shows any DCP checkpoint under
canonical keys: a stock one (no ``mfsdp.json``) through its key layout, any one through the
user's ``--key-map`` rules (:mod:`mfsdp_ckpt.read.stock`). Offline tools (``reshard``) read through
it, so that they plan and write canonical keys whatever wrote the source."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.stock import KeyRule, canonical_names, stock_param_groups

__all__ = ["MappedReader", "is_stock", "map_reader_keys"]


def is_stock(manifest: dict[str, Any] | None) -> bool:
    """Whether entries are named in the stock ``get_state_dict`` layout: a checkpoint without
    ``mfsdp.json``, or one ``convert --to dcp-fsdp2`` wrote (its manifest says so)."""
    return manifest is None or manifest.get("key_layout") == "dcp-fsdp2"


class MappedReader:
    """Entries by canonical name (``keys``, ``read``, ``read_flat``, ``shape``, ``dtype``,
    ``is_tensor``), read from the stored ones by a :class:`CheckpointReader`, which checks every
    chunk. With no rules, a committed mfsdp checkpoint reads exactly as through it. A context
    manager, like it."""

    def __init__(self, path: str | os.PathLike, key_map: Sequence[KeyRule] = ()) -> None:
        self.raw = CheckpointReader(path)
        self.directory, self.manifest, self.metadata = self.raw.directory, self.raw.manifest, self.raw.metadata
        self.key_map = tuple(key_map)
        try:
            self.names = canonical_names(
                self.metadata.state_dict_metadata, self.key_map, stock_layout=is_stock(self.manifest)
            )
        except CheckpointError as e:
            self.close()
            raise CheckpointError(f"{self.directory}: {e}") from None
        self._groups: list[dict[str, Any]] | None = None

    def __enter__(self) -> "MappedReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.raw.close()

    @property
    def stock(self) -> bool:
        return is_stock(self.manifest)

    def source_key(self, key: str) -> str:
        """The stored key of canonical ``key``."""
        try:
            return self.names.sources[key]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no key '{key}'") from None

    def keys(self) -> list[str]:
        return self.names.keys()

    def is_tensor(self, key: str) -> bool:
        if key == PARAM_GROUPS and self.names.group_parts:
            return False
        return self.raw.is_tensor(self.source_key(key))

    def shape(self, key: str) -> torch.Size:
        return self.raw.shape(self.source_key(key))

    def dtype(self, key: str) -> torch.dtype:
        return self.raw.dtype(self.source_key(key))

    def read(self, key: str) -> Any:
        if key == PARAM_GROUPS and self.names.group_parts:
            if self._groups is None:
                self._groups = stock_param_groups(self.names.group_parts, self.raw.read, self.key_map)
            return self._groups
        return self.raw.read(self.source_key(key))

    def read_flat(self, key: str, start: int, end: int) -> torch.Tensor:
        return self.raw.read_flat(self.source_key(key), start, end)


def map_reader_keys(reader: Any, key_map: Sequence[KeyRule], manifest: dict[str, Any] | None) -> list[str]:
    """For ``load``: rename the entries of ``reader`` (a :class:`~mfsdp_ckpt.read.dcp_reader.VerifyingReader`
    whose metadata was read) to canonical keys, in place, so that everything after it (key
    checks, DCP's planner, the chunk reads) sees canonical names; the stored bytes are found by
    their file and offset, which do not change. Returns the stored ``optim.param_groups.<…>``
    entries of a stock checkpoint, kept under their stored names, which together make
    ``optim.param_groups`` (:func:`~mfsdp_ckpt.read.stock.stock_param_groups`). Nothing is renamed
    when there is nothing to rename (a canonical checkpoint and no rules)."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from mfsdp_ckpt.format.checksum import chunk_id
    from mfsdp_ckpt.read.chunks import chunk_shapes
    from mfsdp_ckpt.read.metadata_check import stored_by_key

    metadata = reader.read_metadata()
    names = canonical_names(metadata.state_dict_metadata, key_map, stock_layout=is_stock(manifest))
    renamed = {src: dst for dst, src in names.sources.items() if src != dst}
    if not renamed:
        return names.group_parts
    md = Metadata(
        state_dict_metadata={renamed.get(k, k): v for k, v in metadata.state_dict_metadata.items()},
        planner_data=metadata.planner_data,
        storage_data={
            MetadataIndex(renamed.get(i.fqn, i.fqn), i.offset, i.index): info
            for i, info in metadata.storage_data.items()
        },
        storage_meta=metadata.storage_meta,
        version=metadata.version,
    )
    if reader.manifest_chunks is not None:  # the checksums follow their chunks to the new names
        table = reader.manifest_chunks
        moved = {
            chunk_id(old): chunk_id(MetadataIndex(renamed[old.fqn], old.offset, old.index))
            for old in metadata.storage_data
            if old.fqn in renamed
        }
        reader.manifest_chunks = {moved.get(cid, cid): entry for cid, entry in table.items()}
    reader._metadata, reader.chunk_shapes, reader.stored = md, chunk_shapes(md), stored_by_key(md)
    return names.group_parts
