"""Loading the MX planes of MXFP8 parameters (``mx.<fqn>.<plane>``).

The planes are a function of the fp32 main params, so a load re-derives them and compares them
with the saved ones: a free integrity check, which names the first block that differs (a
checkpoint that passes its checksums but whose planes were written from other weights, or by a
quantizer with other rules). When the checkpoint's main params are not fp32 (a model-only
checkpoint of a bf16 model: the weights are the main params rounded), the planes cannot be
re-derived exactly, and the saved ones are loaded as they are.

Each rank reads the plane ranges of the blocks it owns into temporary tensors; nothing is
compared or written until every rank has read everything (see ``mfsdp_ckpt.load``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.keys import MAIN_PARAM, model_key, mx_key, optim_key
from mfsdp_ckpt.sharded.state import FlatEntry, mx_planes
from mfsdp_core import ParamShard
from mfsdp_core.mx import quantize

__all__ = ["MXTarget", "mx_targets", "check_planes", "write_planes"]

_AXIS = {"rowwise_data": "row", "rowwise_scale": "row", "columnwise_data": "col", "columnwise_scale": "col"}


@dataclass
class MXTarget:
    """One MX parameter's planes to read on this rank: plane name -> (key, temporary target)."""

    shard: ParamShard
    main_key: str  # the key the main params are loaded from
    exact_main: bool  # the main params are stored in fp32: the planes can be derived and compared
    planes: dict[str, tuple[str, FlatEntry]] = field(default_factory=dict)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)  # what was read, once read


def mx_targets(shards: Sequence[ParamShard], saved: dict[str, Any]) -> tuple[list[MXTarget], list[str]]:
    """The MX plane targets of this rank (temporary tensors of the owned ranges), and the planes
    whose stored shape or dtype does not match (``key (checkpoint …, model …)``). A plane the
    checkpoint lacks is derived from the main params, as after any load."""
    out, problems = [], []
    for ps in shards:
        planes = mx_planes(ps)
        if not planes:
            continue
        main_key = optim_key(ps.fqn, MAIN_PARAM) if optim_key(ps.fqn, MAIN_PARAM) in saved else model_key(ps.fqn)
        main_md = saved.get(main_key)
        exact = isinstance(main_md, TensorStorageMetadata) and main_md.properties.dtype == torch.float32
        target = MXTarget(ps, main_key, exact)
        for name, (shape, owned) in planes.items():
            key = mx_key(ps.fqn, name)
            md = saved.get(key)
            if md is None:
                continue
            dtype = owned.tensor.dtype
            if (
                not isinstance(md, TensorStorageMetadata)
                or tuple(md.size) != tuple(shape)
                or md.properties.dtype != dtype
            ):
                found = (
                    f"{tuple(md.size)} {md.properties.dtype}"
                    if isinstance(md, TensorStorageMetadata)
                    else "not a tensor"
                )
                problems.append(f"{key} (checkpoint {found}, model {tuple(shape)} {dtype})")
                continue
            target.planes[name] = (key, FlatEntry(shape, owned.start, owned.end, torch.empty_like(owned.tensor)))
        out.append(target)
    return out, problems


def check_planes(targets: Sequence[MXTarget], reader: Any, main_entries: dict[str, FlatEntry], source: str) -> None:
    """After the read, before anything changes: keep what was read of each plane, and compare it
    with the planes derived from the main params about to be loaded (when those are fp32).
    Raises :class:`CorruptCheckpointError` naming the first differing block."""
    for t in targets:
        for name, (key, entry) in t.planes.items():
            t.staged[name] = reader.preview_flat(key, entry)
        if not (t.exact_main and t.planes) or t.main_key not in main_entries:
            continue
        main = reader.preview_flat(t.main_key, main_entries[t.main_key])
        if main.numel() == 0:
            continue
        fmt, shape = t.shard.spec.placement.mx, t.shard.shape
        rows = main.float().view(-1, shape[1])
        derived = {}
        for axis in ("row", "col"):
            data, scale = quantize(rows, fmt, axis)
            prefix = "rowwise" if axis == "row" else "columnwise"
            derived[f"{prefix}_data"], derived[f"{prefix}_scale"] = data.reshape(-1), scale.reshape(-1)
        for name, (key, entry) in t.planes.items():
            saved_bytes, ours = t.staged[name].view(torch.uint8), derived[name].view(torch.uint8)
            differ = (saved_bytes != ours).nonzero()
            if len(differ):
                j = int(differ[0])
                raise CorruptCheckpointError(
                    f"{source}: key '{key}': the saved plane differs from the one derived from the main params "
                    f"('{t.main_key}') at {_block(name, entry.start + j, shape)} "
                    f"(saved byte 0x{int(saved_bytes[j]):02x}, derived 0x{int(ours[j]):02x})"
                )


def _block(plane: str, index: int, shape: torch.Size) -> str:
    """The weight block a plane element belongs to, in words."""
    cols = int(shape[1])
    if plane == "rowwise_scale":
        r, b = divmod(index, cols // 32)
        return f"the block of row {r}, columns {32 * b}-{32 * b + 31}"
    if plane == "columnwise_scale":
        b, c = divmod(index, cols)
        return f"the block of rows {32 * b}-{32 * b + 31}, column {c}"
    r, c = divmod(index, cols)
    if plane == "rowwise_data":
        return f"element ({r}, {c}) of the block of row {r}, columns {32 * (c // 32)}-{32 * (c // 32) + 31}"
    return f"element ({r}, {c}) of the block of rows {32 * (r // 32)}-{32 * (r // 32) + 31}, column {c}"


def write_planes(targets: Sequence[MXTarget]) -> bool:
    """Copy the planes read into the live owned ranges, for parameters whose planes cannot be
    derived exactly (their main params are not stored in fp32). True when any was written: then
    the caller refreshes the compute params without deriving the planes again."""
    wrote = False
    for t in targets:
        if t.exact_main:
            continue
        for name, staged in t.staged.items():
            t.shard.companions[name].tensor.copy_(staged)
            wrote = True
    return wrote
