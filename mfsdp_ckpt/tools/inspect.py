"""What is in a checkpoint, and whether every byte of it is accounted for.

``inspect_checkpoint`` reads only metadata (``.metadata`` through the safe unpickler, and
``mfsdp.json`` when there is one), so it works on any DCP checkpoint, including ones written by
stock PyTorch, where it says what it cannot know; of a torchtitan checkpoint it also reads the
one small entry holding the trainer's step. ``verify_checkpoint`` reads every chunk.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import CheckpointError, ConversionError
from mfsdp_ckpt.format.base_ref import shown_file
from mfsdp_ckpt.format.checksum import chunk_id
from mfsdp_ckpt.format.keys import GROUPS, group_of, mx_plane_of
from mfsdp_ckpt.format.lora import adapter_pairs, lora_of_record
from mfsdp_ckpt.format.model_source import MEGATRON_CORE, model_source_of
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME
from mfsdp_ckpt.format.titan import STEP_KEY, TITAN_LAYOUT, is_titan_layout
from mfsdp_ckpt.mcore.describe import describe_mcore
from mfsdp_ckpt.model.experts import ep_owner_ranks
from mfsdp_ckpt.read.chunks import ChunkFiles, Fault
from mfsdp_ckpt.read.index_check import index_faults, read_stock_metadata
from mfsdp_ckpt.read.locate import open_checkpoint
from mfsdp_ckpt.read.manifest import is_protected
from mfsdp_ckpt.read.metadata_check import entry_faults, orphan_faults
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.stock import canonical_names, is_stock, uncommitted_reason
from mfsdp_ckpt.storage import fs

__all__ = [
    "TensorInfo",
    "CheckpointInfo",
    "ExpertPlacement",
    "compact_ranges",
    "Fault",
    "Faults",
    "inspect_checkpoint",
    "verify_checkpoint",
    "GROUPS",
]


@dataclass(frozen=True)
class TensorInfo:
    key: str
    group: str  # model / optim / grad / mx / extra / other
    dtype: str | None  # None for a serialized object
    shape: tuple[int, ...] | None
    bytes: int  # logical bytes (numel x itemsize); stored bytes for objects
    chunks: int


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts each EP rank of the writer held, and on which global ranks."""

    ep_size: int
    num_experts: int
    ranks: list[list[int]]  # per EP rank: the global ranks holding its experts (p, p + E, …)
    experts: list[list[int]]  # per EP rank: the global indices of its experts

    @classmethod
    def of_writer(cls, writer: dict[str, Any] | None) -> "ExpertPlacement | None":
        """From the manifest's ``writer`` entry (None when it records no ``experts``)."""
        entry = (writer or {}).get("experts")
        if not entry:
            return None
        size, world = entry["ep_size"], (writer or {}).get("world_size") or entry["ep_size"]
        return cls(
            size,
            sum(len(o) for o in entry["owners"]),
            [ep_owner_ranks(p, size, world) for p in range(size)],
            [list(o) for o in entry["owners"]],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ep_size": self.ep_size,
            "num_experts": self.num_experts,
            "placement": [
                {"ep_rank": p, "ranks": r, "experts": e} for p, (r, e) in enumerate(zip(self.ranks, self.experts))
            ],
        }


def compact_ranges(values: list[int]) -> str:
    """``0-2, 5, 7-8`` for [0, 1, 2, 5, 7, 8] (sorted integers)."""
    parts: list[str] = []
    for v in sorted(values):
        if parts and v == parts[-1][1] + 1:
            parts[-1][1] = v
        else:
            parts.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts) or "none"


@dataclass(frozen=True)
class MXInfo:
    """One MXFP8 parameter: its name, shape, element format and scale rule (None: not recorded,
    a checkpoint without a manifest), and the planes stored for it."""

    fqn: str
    shape: tuple[int, ...]
    element: str | None
    rule: str | None
    planes: tuple[str, ...]

    @property
    def format(self) -> str:
        return f"mxfp8 {self.element or '?'} {self.rule or '?'}"


def mx_tensors(writer: dict[str, Any] | None, keys: dict[str, Any]) -> list[MXInfo]:
    """The MXFP8 parameters of a checkpoint: those whose ``mx.<fqn>.<plane>`` keys it holds, with
    the format the writer's plan records for them."""
    planes: dict[str, list[str]] = {}
    for key in keys:
        found = mx_plane_of(key)
        if found is not None:
            planes.setdefault(found[0], []).append(found[1])
    formats = {}
    for buf in ((writer or {}).get("plan") or {}).get("buffers", []):
        mx = buf.get("mx")
        if isinstance(mx, dict):
            for name, shape in zip(buf.get("params", []), buf.get("shapes", [])):
                formats[name] = (mx.get("element"), mx.get("rule"), tuple(shape))
    out = []
    for fqn in sorted(planes):
        element, rule, shape = formats.get(fqn, (None, None, ()))
        md = keys.get(f"model.{fqn}")
        if not shape and isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
        out.append(MXInfo(fqn, shape, element, rule, tuple(sorted(planes[fqn]))))
    return out


@dataclass
class CheckpointInfo:
    path: str
    format: str  # "mfsdp", "stock DCP", "torchtitan" (its layout, ours or its own), Megatron-Core's
    committed: bool
    step: int | None
    writer: dict[str, Any] | None
    model_config: dict[str, Any] | None
    model_source: dict[str, Any] | None = None  # what the weights belong to (mfsdp_ckpt.format.model_source)
    tensors: list[TensorInfo] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # what a stock checkpoint cannot tell
    experts: ExpertPlacement | None = None  # the writer's expert parallelism, if it had any
    mx: list[MXInfo] = field(default_factory=list)  # MXFP8 parameters (with their planes)
    # the base it references (frozen weights, written once): its name and the entries it holds
    base: dict[str, Any] | None = None

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for t in self.tensors:
            g = out.setdefault(t.group, {"tensors": 0, "bytes": 0})
            g["tensors"] += 1
            g["bytes"] += t.bytes
        return out

    def to_json(self) -> dict[str, Any]:
        """docs/cli.md's JSON vocabulary: what does not apply (a stock checkpoint's step, an object's
        ``dtype`` and ``shape`` in ``tensor_list``) is absent, not null."""
        out = {
            "path": self.path,
            "format": self.format,
            "committed": self.committed,
            "step": self.step,
            "writer": self.writer,
            "model_config": self.model_config,
            "model_source": self.model_source,
            "unknown": self.unknown,
            "experts": self.experts.to_json() if self.experts else None,
            "mx": [
                {"fqn": m.fqn, "shape": list(m.shape), "element": m.element, "rule": m.rule, "planes": list(m.planes)}
                for m in self.mx
            ],
            "base": self.base,
            "totals": self.totals(),
            "tensors": len(self.tensors),
            "tensor_list": [{k: v for k, v in t.__dict__.items() if v is not None} for t in self.tensors],
        }
        return {k: v for k, v in out.items() if v is not None}


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Format, step, writer layout, model config and every tensor of the checkpoint at ``path``."""
    directory, manifest, metadata, reader = open_checkpoint(os.fspath(path))
    info = CheckpointInfo(
        path=directory,
        format="mfsdp" if manifest else "stock DCP",
        committed=manifest is not None,
        step=(manifest or {}).get("step"),
        writer=(manifest or {}).get("writer"),
        model_config=(manifest or {}).get("model_config"),
        model_source=model_source_of(manifest),
        experts=ExpertPlacement.of_writer((manifest or {}).get("writer")),
        mx=mx_tensors((manifest or {}).get("writer"), metadata.state_dict_metadata),
    )
    if manifest is None:
        info.unknown = ["writer layout", "model config", "step", "checksums (no mfsdp.json)"]
    elif not is_protected(manifest):
        info.unknown = [UNPROTECTED]
    if reader.base is not None:
        held = reader.base.indexed.catalog.keys
        info.base = {"name": fs.basename(reader.base.directory), "entries": len(held)}
    if manifest is None or manifest.get("key_layout") == "mcore-torch_dist":  # a Megatron-Core checkpoint
        mcore = describe_mcore(directory)
        if mcore is not None:
            info.format, info.step = mcore["format"], mcore["step"] if info.step is None else info.step
            info.model_config = info.model_config or mcore["model_config"]
            info.model_source = info.model_source or {"kind": MEGATRON_CORE}  # written by MCore itself
            info.unknown = [u for u in info.unknown if u not in ("model config", "step")] + mcore["unknown"]
    groups = _titan_groups(manifest, metadata)
    if groups is not None:
        _describe_titan(info, directory, manifest)
    for key in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[key]
        group = groups[key] if groups is not None else group_of(key)
        if isinstance(md, TensorStorageMetadata):
            numel = math.prod(md.size)
            info.tensors.append(
                TensorInfo(
                    key,
                    group,
                    str(md.properties.dtype).replace("torch.", ""),
                    tuple(md.size),
                    numel * md.properties.dtype.itemsize,
                    len(md.chunks),
                )
            )
        else:
            length = sum(v.length for _, v in reader.stored.get(key, []))
            info.tensors.append(TensorInfo(key, group, None, None, length, 1))
    return info


def _titan_groups(manifest: dict[str, Any] | None, metadata: Metadata) -> dict[str, str] | None:
    """Each stored key's group in a torchtitan-layout checkpoint (its own, or one we wrote in its
    layout): the model's bare names ``model``, ``optimizer.*`` ``optim``, the trainer's entries
    ``other``; None for any other checkpoint."""
    if not is_stock(manifest) or not is_titan_layout(set(metadata.state_dict_metadata)):
        return None
    names = canonical_names(metadata.state_dict_metadata)
    groups = {stored: group_of(name) for name, stored in names.sources.items()}
    groups.update((stored, "optim") for stored in names.group_parts)
    return groups


def _describe_titan(info: CheckpointInfo, directory: str, manifest: dict[str, Any] | None) -> None:
    """A torchtitan-layout checkpoint's format, and for torchtitan's own its step: the trainer's
    ``train_state.step`` (one small entry read, through the checked reader)."""
    info.format = TITAN_LAYOUT
    if manifest is not None:
        return
    try:
        with CheckpointReader(directory) as reader:
            step = reader.read(STEP_KEY) if STEP_KEY in reader.metadata.state_dict_metadata else None
    except CheckpointError:
        step = None
    if isinstance(step, int) and not isinstance(step, bool):
        info.step = step
        info.unknown = [u for u in info.unknown if u != "step"]


UNPROTECTED = "manifest checksum (format version 1: written before manifests carried manifest_crc32c)"


class Faults(list):
    """The faults :func:`verify_checkpoint` found (a list of :class:`Fault`), and ``notes``: what
    it could not check, which is no fault (e.g. a manifest written before manifests carried a
    checksum)."""

    def __init__(self, faults: list[Fault] = (), notes: list[str] = ()) -> None:  # type: ignore[assignment]
        super().__init__(faults)
        self.notes = list(notes)


def verify_checkpoint(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> Faults:
    """Every fault found; an empty list means the checkpoint is sound. An integrity gate: what it
    passes, ``load`` reads.

    It checks that the manifest is sound and matches its own checksum, and ``.metadata`` the
    manifest's checksum of it (both refused outright, as every reader does); that ``.metadata``
    and the manifest belong to the same save (``save_id``) and name the same chunks, both ways,
    at the same places; that every tensor's chunks cover it exactly once, each listed chunk has
    stored data and each stored chunk is listed; and that every chunk's bytes are present,
    readable, inside the checkpoint and match their crc32c. A stock DCP checkpoint (no
    ``mfsdp.json``) has no checksums: everything else is checked and a note says so (a
    ``.partial`` directory without one is a fault: a save that never committed). ``progress(done, total)`` counts
    stored bytes checked. The result's ``notes`` say what could not be checked."""
    directory, manifest, metadata, reader = open_checkpoint(os.fspath(path))
    faults: list[Fault] = []
    notes: list[str] = []
    if manifest is None and (mark := uncommitted_reason(directory, metadata)) is not None:
        faults.append(
            Fault(
                MANIFEST_NAME,
                "-",
                None,
                f"missing ({mark}): a save that never committed, or a deleted manifest; no checksums to verify",
            )
        )
    elif manifest is None:
        notes.append(
            f"{MANIFEST_NAME}: absent (a stock DCP checkpoint): checksums are not available; coverage and every "
            "chunk's bytes (present, inside its file, readable) are checked"
        )
    else:
        if not is_protected(manifest):
            notes.append(f"{MANIFEST_NAME}: unprotected: {UNPROTECTED}")
        if reader.indexed is not None:  # the index is what our readers use; .metadata must say the same
            stock = read_stock_metadata(directory, manifest)
            faults += _save_id_faults(manifest, stock)
            faults += index_faults(reader.indexed, stock)
        else:
            faults += _save_id_faults(manifest, metadata)
        if reader.base is not None:  # the base's own .metadata against its index, as above
            base = reader.base
            stock = read_stock_metadata(base.directory, base.manifest)
            name = fs.basename(base.directory)
            faults += [
                Fault(f"{name}/{f.file}" if f.file else name, f.key, f.offset, f.message)
                for f in _save_id_faults(base.manifest, stock) + index_faults(base.indexed, stock)
            ]
    for key, md in metadata.state_dict_metadata.items():
        faults += entry_faults(key, md, reader.stored.get(key, []), METADATA_NAME)
    faults += orphan_faults(metadata, METADATA_NAME)
    if manifest is not None and reader.indexed is None:
        faults += _manifest_chunk_faults(manifest, metadata)
    if manifest is not None:
        faults += _lora_faults(manifest, metadata)
    storage = metadata.storage_data
    total, done = sum(info.length for info in storage.values()), 0
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        for index, info in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            done += info.length
            if progress is not None:
                progress(done, total)
            offset = tuple(index.offset) if index.offset is not None else None
            fault = files.fault(index, info)
            if fault:
                faults.append(Fault(shown_file(info.relative_path), index.fqn, offset, fault))
    return Faults(faults, notes)


def _lora_faults(manifest: dict[str, Any], metadata: Metadata) -> list[Fault]:
    """The LoRA record (``model_source.lora``) against the adapters the checkpoint holds, each
    factor against the weight it adapts (read from the base when it references one), as the
    exports and ``--resume`` check it (the schema checked the targets and the factors' rank)."""
    record = model_source_of(manifest) or {}
    try:
        spec = lora_of_record(record, MANIFEST_NAME)
        shapes = {
            k: tuple(md.size)
            for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and group_of(k) == "model"
        }
        adapter_pairs(shapes, spec, MANIFEST_NAME)
    except (ValueError, ConversionError) as e:
        return [Fault(MANIFEST_NAME, "model_source.lora", None, str(e).removeprefix(f"{MANIFEST_NAME}: "))]
    return []


def _save_id_faults(manifest: dict[str, Any], metadata: Metadata) -> list[Fault]:
    """The manifest and ``.metadata`` name the same save."""
    ours = manifest.get("save_id")
    theirs = metadata.storage_meta.save_id if metadata.storage_meta is not None else None
    if ours is None:
        return [Fault(MANIFEST_NAME, "-", None, "records no save_id: cannot tell whether .metadata belongs to it")]
    if theirs is None:
        return [Fault(METADATA_NAME, "-", None, "records no save_id: cannot tell whether the manifest belongs to it")]
    if ours != theirs:
        return [Fault(MANIFEST_NAME, "-", None, "save_id differs from .metadata: the manifest belongs to another save")]
    return []


def _manifest_chunk_faults(manifest: dict[str, Any], metadata: Metadata) -> list[Fault]:
    """The chunks ``.metadata`` lists (each tensor's chunk list, each object) against the
    manifest's chunk table, both ways. (A stored chunk the manifest lacks, or places elsewhere,
    is reported when its data is checked.)"""
    listed: set[str] = set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            listed.update(chunk_id(MetadataIndex(key, torch.Size(c.offsets))) for c in md.chunks)
        else:
            listed.add(key)
    stored = {chunk_id(index) for index in metadata.storage_data}
    table = manifest["chunks"]
    faults = [
        Fault(METADATA_NAME, cid, None, "in the metadata's chunk list, but not in the manifest")
        for cid in sorted(listed - set(table))
        if cid not in stored
    ]
    faults += [
        Fault(MANIFEST_NAME, cid, None, "listed in the manifest but not in .metadata")
        for cid in sorted(set(table) - (listed & stored))
    ]
    return faults
