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
from .errors import NotACheckpointError
from .keys import GROUPS, group_of
from .manifest import MANIFEST_NAME, read_manifest
from .planner import chunk_id
from .storage import ChunkFault, VerifyingReader, read_chunk

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


@dataclass(frozen=True)
class Fault:
    file: str | None
    key: str
    offset: tuple[int, ...] | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        at = f" at {list(self.offset)}" if self.offset is not None else ""
        return f"{where}{self.key}{at}: {self.message}"


def _coverage_faults(key: str, md: TensorStorageMetadata) -> list[Fault]:
    """Every element covered exactly once: chunks in bounds, pairwise disjoint, volumes summing
    to the tensor's."""
    faults = []
    size = tuple(md.size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    for off, sz in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            faults.append(Fault(None, key, off, f"chunk of size {list(sz)} lies outside the tensor {list(size)}"))
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if all(a0 < b0 + bs and b0 < a0 + as_ for a0, as_, b0, bs in zip(oa, sa, ob, sb)):
                faults.append(Fault(None, key, ob, f"chunk overlaps the chunk at {list(oa)}"))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size) and not faults:
        faults.append(Fault(None, key, None, f"chunks cover {covered} of {math.prod(size)} elements"))
    return faults


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
            faults += _coverage_faults(key, md)
    storage = metadata.storage_data or {}
    listed = set((manifest or {}).get("chunks", {}))
    seen = set()
    handles: dict[str, Any] = {}
    shapes = reader.chunk_shapes
    total, done = sum(info.length for info in storage.values()), 0
    try:
        for index, info in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            done += info.length
            if progress is not None:
                progress(done, total)
            cid = chunk_id(index)
            seen.add(cid)
            offset = tuple(index.offset) if index.offset is not None else None
            fault = _check_chunk(directory, info, index, manifest, handles, shapes)
            if fault:
                faults.append(Fault(info.relative_path, index.fqn, offset, fault))
    finally:
        for f in handles.values():
            if f is not None:
                f.close()
    for cid in sorted(listed - seen):
        faults.append(Fault(MANIFEST_NAME, cid, None, "listed in the manifest but not in .metadata"))
    return faults


def _check_chunk(directory: str, info: Any, index: Any, manifest: dict | None, handles: dict, shapes: dict) -> str | None:
    if info.relative_path not in handles:
        try:
            handles[info.relative_path] = fs.open_file(fs.join(directory, info.relative_path))
        except OSError as e:
            handles[info.relative_path] = None
            return f"cannot open ({e.strerror})"
    f = handles[info.relative_path]
    if f is None:
        return "cannot open"
    try:
        read_chunk(f, info, index, manifest["chunks"] if manifest else None, shapes.get(index))
    except ChunkFault as e:
        return str(e)
    return None
