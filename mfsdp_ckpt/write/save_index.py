"""The coordinator's side of a save's commit: from what every rank wrote, the checkpoint's index
(the catalog of :mod:`mfsdp_ckpt.format.catalog` with its key table, and every data file) and
the stock ``.metadata``, after checking that every rank wrote exactly the chunks the catalog
gives it (so that a reader deriving chunks from the index finds them all, each once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.catalog import OWNED, PLANE, Catalog, CatalogError, KeyInfo, replace_keys
from mfsdp_ckpt.format.keys import mx_plane_of
from mfsdp_ckpt.format.record_table import DataFile
from mfsdp_core.dtypes import dtype_name

__all__ = ["RankWrites", "declared_keys", "build_index", "INDEX_VERSION"]

INDEX_VERSION = 1

Declared = tuple[TensorProperties | None, tuple[int, ...] | None, str | None]


@dataclass
class RankWrites:
    """What one rank sends the coordinator after writing: its write results, the keys it wrote
    (properties, shape, and :data:`OWNED` / :data:`PLANE` for cut state, None for an object)
    and its data files."""

    results: list[WriteResult] = field(default_factory=list)
    declared: dict[str, Declared] = field(default_factory=dict)
    files: list[DataFile] = field(default_factory=list)


def declared_keys(plan: SavePlan) -> dict[str, Declared]:
    """The keys of a rank's write items: cut state (``SHARD`` items; MX planes by their key),
    whole tensors and serialized objects."""
    out: dict[str, Declared] = {}
    for item in plan.items:
        key = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            out[key] = (None, None, None)
            continue
        td = item.tensor_data
        kind = (PLANE if mx_plane_of(key) is not None else OWNED) if item.type == WriteItemType.SHARD else None
        out[key] = (td.properties, tuple(td.size), kind)
    return out


def _keys(per_rank: Sequence[RankWrites]) -> tuple[dict[str, KeyInfo], dict[str, TensorProperties | None]]:
    keys: dict[str, KeyInfo] = {}
    props: dict[str, TensorProperties | None] = {}
    first: dict[str, int] = {}
    for r, rw in enumerate(per_rank):
        for key, (p, size, kind) in rw.declared.items():
            info = KeyInfo(dtype_name(p.dtype) if p is not None else None, size, kind if kind is not None else r)
            prev = keys.get(key)
            if prev is None:
                keys[key], props[key], first[key] = info, p, r
            elif isinstance(prev.where, int) and isinstance(info.where, int):
                raise CheckpointError(f"save: key '{key}' was written whole by rank {prev.where} and by rank {r}")
            elif prev != info:
                raise CheckpointError(
                    f"save: key '{key}' is {prev.dtype} {list(prev.shape or ())} on rank {first[key]} "
                    f"but {info.dtype} {list(info.shape or ())} on rank {r}"
                )
    return keys, props


def build_index(catalog: Catalog, per_rank: Sequence[RankWrites]) -> tuple[Metadata, list[WriteResult], dict[str, Any]]:
    """``.metadata`` (without its storage data, which DCP's ``finish`` adds from the results),
    every rank's write results and the index for the manifest. :class:`CheckpointError` naming
    the key and ranks when what was written is not what the catalog gives (nothing is committed
    then)."""
    keys, props = _keys(per_rank)
    catalog = replace_keys(catalog, keys)
    written: dict[tuple[str, tuple[int, ...]], int] = {}
    for r, rw in enumerate(per_rank):
        for wr in rw.results:
            written[(wr.index.fqn, tuple(wr.index.offset or ()))] = r
    md: dict[str, Any] = {}
    count = 0
    for key in sorted(keys):
        info = keys[key]
        try:
            chunks = catalog.chunks(key)
        except CatalogError as e:
            raise CheckpointError(f"save: {e}") from None
        for r, box in chunks:
            w = written.get((key, box.offsets))
            if w != r:
                by = f"rank {w} wrote it" if w is not None else "no rank wrote it"
                raise CheckpointError(
                    f"save: key '{key}' chunk at {list(box.offsets)}: the layout gives it to rank {r}, {by}"
                )
        count += len(chunks)
        if info.dtype is None:
            md[key] = BytesStorageMetadata()
            continue
        p = props[key]
        assert p is not None
        md[key] = TensorStorageMetadata(
            properties=p,
            size=torch.Size(info.shape or ()),
            chunks=[ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for _, b in chunks],
        )
    if count != len(written):
        derived = {(k, b.offsets) for k in keys for _, b in catalog.chunks(k)}
        key, offsets = next(kw for kw in written if kw not in derived)
        raise CheckpointError(
            f"save: rank {written[(key, offsets)]} wrote key '{key}' chunk at {list(offsets)}, which the layout does not give it"
        )
    results = [wr for rw in per_rank for wr in rw.results]
    index = {
        "version": INDEX_VERSION,
        **catalog.to_dict(),
        "files": [f.to_list() for rw in per_rank for f in rw.files],
    }
    return Metadata(state_dict_metadata=md), results, index
