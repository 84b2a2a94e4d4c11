"""The sidecar manifest ``mfsdp.json``: human-readable, never pickled. Its presence marks a
committed checkpoint; it records the writer's layout (its placement plan), the model config, the
step, versions, time, and a crc32c for every chunk's payload."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch

from mfsdp_core.dtypes import dtype_name
from mfsdp_core.plan import DEFAULT_GROUP, ModelPlan

from . import fs
from .errors import CorruptCheckpointError, UncommittedCheckpointError

__all__ = ["MANIFEST_NAME", "FORMAT", "FORMAT_VERSION", "completed", "versions", "writer_layout", "recorded_plan", "read_manifest", "write_manifest", "is_committed"]

MANIFEST_NAME = "mfsdp.json"
FORMAT = "mfsdp-ckpt"
FORMAT_VERSION = 1


def writer_layout(world_size: int, plan: ModelPlan) -> dict[str, Any]:
    """The manifest's ``writer`` entry: the world size, the placement plan (every flat buffer's
    parameters in buffer order with its shapes, strategy, policy, group and divisor: what
    ``reshard`` computes another layout from), and a one-line-per-kind summary (what ``inspect``
    shows)."""
    kinds = sorted({(b.strategy.value, str(b.policy), b.placement.group, b.shard_size_ranks) for b in plan.buffers})
    return {
        "world_size": world_size,
        "buffers": [{"strategy": s, "policy": p, "group": g, "group_size": n} for s, p, g, n in kinds],
        "plan": plan.to_dict(),
    }


def recorded_plan(manifest: dict[str, Any], shape_of: Callable[[str], torch.Size | None],
                  dtype_of: Callable[[str], torch.dtype | None]) -> ModelPlan | None:
    """The placement plan the writer recorded, or None when it recorded none. Manifests written
    before the plan existed list ``writer.groups`` (parameters, strategy, policy, group size);
    their shapes and dtypes come from the checkpoint's tensors (``shape_of`` / ``dtype_of`` of a
    parameter name)."""
    writer = manifest.get("writer") or {}
    if "plan" in writer:
        return ModelPlan.from_dict(writer["plan"])
    groups = writer.get("groups")
    if groups is None:
        return None
    world = int(writer.get("world_size") or 1)
    buffers = []
    for g in groups:
        names = list(g["params"])
        shapes = [shape_of(n) for n in names]
        dtype = next((d for d in map(dtype_of, names) if d is not None), torch.float32)
        shards = g["strategy"] != "no_shard"
        buffers.append({"params": names, "shapes": [list(s) if s is not None else None for s in shapes],
                        "dtype": dtype_name(dtype), "strategy": g["strategy"], "policy": g["policy"],
                        "group_size": g["group_size"] if shards else world, "is_expert": g.get("is_expert", False)})
    return ModelPlan.from_dict({"group_sizes": {DEFAULT_GROUP: world}, "buffers": buffers})


def versions() -> dict[str, str]:
    """The software that wrote a checkpoint, for its manifest."""
    import torch

    try:
        from importlib.metadata import version

        ours = version("mfsdp-ckpt")
    except Exception:  # noqa: BLE001 - running from a source tree without an install
        ours = "unknown"
    return {"torch": torch.__version__, "mfsdp_ckpt": ours}


def completed(manifest: dict[str, Any], save_id: str, chunks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``manifest`` plus what every committed checkpoint's manifest holds: format and version, the
    save id ``.metadata`` carries too, the time, every chunk's place and crc32c, total bytes."""
    return {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "save_id": save_id,
            "created_unix": time.time(), "chunks": chunks, "total_bytes": sum(c["length"] for c in chunks.values())}


def write_manifest(directory: str, manifest: dict[str, Any], sync: bool = True) -> None:
    """Write ``mfsdp.json`` in ``directory`` (local: via a temporary file and a rename; object
    store: one upload)."""
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    fs.write_bytes(fs.join(directory, MANIFEST_NAME), text.encode(), sync=sync)


def is_committed(directory: str) -> bool:
    return fs.isfile(fs.join(directory, MANIFEST_NAME))


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a committed checkpoint (local path or fsspec URL); raises if it is missing
    or not ours."""
    path = fs.join(directory, MANIFEST_NAME)
    if not fs.isfile(path):
        raise UncommittedCheckpointError(
            f"{directory}: no committed manifest ({MANIFEST_NAME}); the save did not finish or this is not an mfsdp checkpoint"
        )
    try:
        manifest = json.loads(fs.read_bytes(path))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not an {FORMAT} manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path}: format version {manifest.get('format_version')} is newer than this reader ({FORMAT_VERSION})"
        )
    return manifest
