"""Where every chunk of a checkpoint lives: which rank wrote it, which part of which tensor it is,
and which bytes of which file hold it. What the HTML report draws.

Read from metadata only (``.metadata`` and ``mfsdp.json``), so it works for our checkpoints,
stock DCP ones and Megatron-Core's ``torch_dist`` ones alike. The writing rank is taken from the
data file's name (DCP names them ``__<rank>_<n>.distcp``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mfsdp_ckpt.format.keys import group_of
from mfsdp_ckpt.format.names import dcp_data_file_rank
from mfsdp_ckpt.read.locate import open_checkpoint
from mfsdp_ckpt.tools.inspect import CheckpointInfo, inspect_checkpoint
from mfsdp_core.plan import ModelPlan

__all__ = ["ChunkView", "BufferPadding", "CheckpointLayout", "checkpoint_layout", "writer_rank"]


def writer_rank(file: str) -> int | None:
    """The rank that wrote a DCP data file, from its name; None for a name DCP does not give."""
    return dcp_data_file_rank(file)


@dataclass(frozen=True)
class ChunkView:
    """One stored chunk: a box of a tensor (``offsets``, ``sizes``; empty for an object) and the
    bytes ``[file_offset, file_offset + length)`` of ``file`` that hold it."""

    key: str
    group: str
    rank: int | None
    file: str
    file_offset: int
    length: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class BufferPadding:
    """One flat buffer of the writer's plan and the padding its shards carry."""

    unit: str
    params: int
    policy: str
    strategy: str
    group: str
    group_size: int
    elements: int
    padding: int
    per_rank: tuple[int, ...]  # padding elements in each group rank's shard


@dataclass
class CheckpointLayout:
    info: CheckpointInfo
    chunks: list[ChunkView] = field(default_factory=list)
    buffers: list[BufferPadding] = field(default_factory=list)
    replicas: int = 1  # HSDP / HFSDP replica groups of the writer (1 without)
    manifest: dict[str, Any] | None = None  # mfsdp.json as read (None for a stock or MCore checkpoint)

    @property
    def ranks(self) -> list[int]:
        """Every writing rank: the writer's world size when recorded, else those seen in files."""
        world = (self.info.writer or {}).get("world_size")
        seen = {c.rank for c in self.chunks if c.rank is not None}
        return sorted(set(range(world)) | seen) if world else sorted(seen)

    def replica_of(self, rank: int) -> int | None:
        """The HSDP replica group a writer rank belonged to (None without HSDP)."""
        world = (self.info.writer or {}).get("world_size")
        if self.replicas <= 1 or not world:
            return None
        return rank // (world // self.replicas)

    def ep_rank_of(self, rank: int) -> int | None:
        """The EP rank of a writer rank (EP rank p is ranks p, p + E, ...); None without EP."""
        x = self.info.experts
        return None if x is None else rank % x.ep_size

    def files(self) -> dict[str, dict[str, int]]:
        """Per data file: bytes used by chunks and the chunk count."""
        out: dict[str, dict[str, int]] = {}
        for c in self.chunks:
            f = out.setdefault(c.file, {"bytes": 0, "chunks": 0, "end": 0})
            f["bytes"] += c.length
            f["chunks"] += 1
            f["end"] = max(f["end"], c.file_offset + c.length)
        return dict(sorted(out.items()))


def checkpoint_layout(path: str | os.PathLike) -> CheckpointLayout:
    """The layout of the checkpoint at ``path`` (metadata only; no chunk is read)."""
    info = inspect_checkpoint(path)
    _, manifest, metadata, reader = open_checkpoint(os.fspath(path))
    out = CheckpointLayout(info, manifest=manifest)
    for key in sorted(reader.stored):
        md = metadata.state_dict_metadata.get(key)
        sizes_at = (
            {tuple(c.offsets): tuple(c.sizes) for c in md.chunks} if isinstance(md, TensorStorageMetadata) else {}
        )
        for index, stored in sorted(reader.stored[key], key=lambda s: tuple(s[0].offset or ())):
            offsets = tuple(index.offset) if index.offset is not None else ()
            out.chunks.append(
                ChunkView(
                    key,
                    group_of(key),
                    writer_rank(stored.relative_path),
                    stored.relative_path,
                    stored.offset,
                    stored.length,
                    offsets,
                    sizes_at.get(offsets, ()),
                )
            )
    plan = ((manifest or {}).get("writer") or {}).get("plan")
    if plan:
        out.buffers, out.replicas = _paddings(plan)
    return out


def _paddings(plan: dict[str, Any]) -> tuple[list[BufferPadding], int]:
    buffers, replicas = [], 1
    for spec in ModelPlan.from_dict(plan).buffers:
        layout = spec.layout
        replicas = max(replicas, spec.replicate_size)
        buffers.append(
            BufferPadding(
                unit=spec.prefix.rstrip(".") or "(root)",
                params=len(spec.names),
                policy=str(spec.placement.policy),
                strategy=spec.strategy.value if hasattr(spec.strategy, "value") else str(spec.strategy),
                group=spec.placement.group,
                group_size=spec.group_size,
                elements=sum(math.prod(s) for s in spec.shapes),
                padding=layout.padding,
                per_rank=tuple(layout.shard_size - n for n in layout.rank_lengths),
            )
        )
    return buffers, replicas
