"""What is in a checkpoint, and whether every byte of it is accounted for.

``inspect_checkpoint`` reads only metadata (``.metadata`` through the safe unpickler, and
``mfsdp.json`` when there is one), so it works on any DCP checkpoint, including ones written by
stock PyTorch, where it says what it cannot know. ``verify_checkpoint`` reads every chunk.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from . import fs
from .chunks import ChunkFiles, Fault, coverage_faults
from .errors import NotACheckpointError
from .keys import GROUPS, group_of
from .manifest import MANIFEST_NAME, read_manifest
from .planner import chunk_id
from .storage import VerifyingReader

__all__ = ["TensorInfo", "CheckpointInfo", "Fault", "inspect_checkpoint", "verify_checkpoint", "GROUPS"]


@dataclass(frozen=True)
class TensorInfo:
    key: str
    group: str  # model / optim / grad / mx / extra / other
    dtype: str | None  # None for a serialized object
    shape: tuple[int, ...] | None
    bytes: int  # logical bytes (numel x itemsize); stored bytes for objects
    chunks: int


@dataclass
class CheckpointInfo:
    path: str
    format: str  # "mfsdp" or "stock DCP"
    committed: bool
    step: int | None
    writer: dict[str, Any] | None
    model_config: dict[str, Any] | None
    tensors: list[TensorInfo] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # what a stock checkpoint cannot tell

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for t in self.tensors:
            g = out.setdefault(t.group, {"tensors": 0, "bytes": 0})
            g["tensors"] += 1
            g["bytes"] += t.bytes
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "committed": self.committed,
            "step": self.step,
            "writer": self.writer,
            "model_config": self.model_config,
            "unknown": self.unknown,
            "totals": self.totals(),
            "tensors": [t.__dict__ for t in self.tensors],
        }


def open_checkpoint(path: str) -> tuple[str, dict[str, Any] | None, Metadata, VerifyingReader]:
    """(directory, manifest or None, DCP metadata read safely, a verifying reader) for ``path``."""
    from .checkpoint import resolve_checkpoint

    directory = resolve_checkpoint(path)
    if not fs.isfile(fs.join(directory, ".metadata")):
        if fs.isdir(directory) and any(n.endswith(".distcp") for n in fs.listdir(directory)):
            raise NotACheckpointError(f"{directory}: no .metadata: the save did not finish")
        raise NotACheckpointError(f"{directory}: not a checkpoint (no .metadata)")
    manifest = read_manifest(directory) if fs.isfile(fs.join(directory, MANIFEST_NAME)) else None
    reader = VerifyingReader(directory, manifest)
    metadata = reader.read_metadata()
    return directory, manifest, metadata, reader


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Format, step, writer layout, model config and every tensor of the checkpoint at ``path``."""
    directory, manifest, metadata, _ = open_checkpoint(os.fspath(path))
    info = CheckpointInfo(
        path=directory,
        format="mfsdp" if manifest else "stock DCP",
        committed=manifest is not None,
        step=(manifest or {}).get("step"),
        writer=(manifest or {}).get("writer"),
        model_config=(manifest or {}).get("model_config"),
    )
    if manifest is None:
        info.unknown = ["writer layout", "model config", "step", "checksums (no mfsdp.json)"]
    storage = metadata.storage_data or {}
    for key in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            numel = math.prod(md.size)
            info.tensors.append(
                TensorInfo(key, group_of(key), str(md.properties.dtype).replace("torch.", ""), tuple(md.size),
                           numel * md.properties.dtype.itemsize, len(md.chunks))
            )
        else:
            length = sum(v.length for k, v in storage.items() if k.fqn == key)
            info.tensors.append(TensorInfo(key, group_of(key), None, None, length, 1))
    return info


def verify_checkpoint(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> list[Fault]:
    """Every fault found: coverage gaps / overlaps, chunks missing from the manifest or the
    manifest naming chunks the metadata lacks, missing or short files, unreadable chunks and
    checksum mismatches. An empty list means the checkpoint is sound. ``progress(done, total)``
    counts stored bytes checked."""
    directory, manifest, metadata, reader = open_checkpoint(os.fspath(path))
    faults: list[Fault] = []
    if manifest is None:
        faults.append(Fault(MANIFEST_NAME, "-", None, "missing: not a committed mfsdp checkpoint (no checksums to verify)"))
    elif metadata.storage_meta is not None and manifest.get("save_id") not in (None, metadata.storage_meta.save_id):
        faults.append(Fault(MANIFEST_NAME, "-", None, "save_id differs from .metadata: the manifest belongs to another save"))
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            faults += coverage_faults(key, md)
    storage = metadata.storage_data or {}
    listed = set((manifest or {}).get("chunks", {}))
    seen = set()
    total, done = sum(info.length for info in storage.values()), 0
    with ChunkFiles(directory, manifest["chunks"] if manifest else None, reader.chunk_shapes) as files:
        for index, info in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            done += info.length
            if progress is not None:
                progress(done, total)
            cid = chunk_id(index)
            seen.add(cid)
            offset = tuple(index.offset) if index.offset is not None else None
            fault = files.fault(index, info)
            if fault:
                faults.append(Fault(info.relative_path, index.fqn, offset, fault))
    for cid in sorted(listed - seen):
        faults.append(Fault(MANIFEST_NAME, cid, None, "listed in the manifest but not in .metadata"))
    return faults
