"""Building the sidecar manifest ``mfsdp.json``: the fields every writer records (the writer's
layout, the software versions, the format and save id, the chunks or the index) and the
manifest's own checksum. Pure functions of values: the writers (:mod:`mfsdp_ckpt.write`) put the
bytes :func:`sealed_manifest` returns in place; the readers (:mod:`mfsdp_ckpt.read.manifest`)
check the same checksum.

The manifest protects itself and ``.metadata``: ``manifest_crc32c`` is the crc32c of the canonical
JSON of every other field (:func:`manifest_checksum`), ``metadata_crc32c`` the crc32c of the bytes
of ``.metadata``. Both are added by :func:`sealed_manifest`. Manifests of format version 1 were
written before these fields existed."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.format.manifest_schema import check_manifest

if TYPE_CHECKING:  # the plan is passed in; building a manifest imports no torch
    from mfsdp_core.plan import ModelPlan

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "writer_layout",
    "versions",
    "completed",
    "indexed",
    "manifest_checksum",
    "sealed_manifest",
]

FORMAT = "mfsdp-ckpt"
# 3: a save's manifest holds an index of its layout instead of every chunk (``chunks`` remains
# for the offline tools' checkpoints); 2: the manifest carries manifest_crc32c (and
# metadata_crc32c); 1: it does not
FORMAT_VERSION = 3


def writer_layout(world_size: int, plan: ModelPlan, experts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's ``writer`` entry: the world size, the placement plan (every flat buffer's
    parameters in buffer order with its shapes, strategy, policy, group and divisor: what
    ``reshard`` computes another layout from; under expert parallelism the merged plan of every
    rank), a one-line-per-kind summary (what ``inspect`` shows), and with expert parallelism
    ``experts``: the EP size and the global expert indices each EP rank held."""
    kinds = sorted({(b.strategy.value, str(b.policy), b.placement.group, b.shard_size_ranks) for b in plan.buffers})
    out = {
        "world_size": world_size,
        "buffers": [{"strategy": s, "policy": p, "group": g, "group_size": n} for s, p, g, n in kinds],
        "plan": plan.to_dict(),
    }
    if experts is not None:
        out["experts"] = experts
    return out


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
    return {
        # a source's index does not describe these chunks; its base reference and role stay with
        # it (an offline tool's output holds every entry it writes itself)
        **{k: v for k, v in manifest.items() if k not in ("index", "base", "role")},
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "created_unix": time.time(),
        "chunks": chunks,
        "total_bytes": sum(c["length"] for c in chunks.values()),
    }


def indexed(manifest: dict[str, Any], save_id: str, index: dict[str, Any], total_bytes: int) -> dict[str, Any]:
    """``manifest`` plus what a committed save's manifest holds: format and version, the save id
    ``.metadata`` carries too, the time, the index of its layout (:mod:`mfsdp_ckpt.format.catalog`:
    its chunks are derived from it, their places and checksums are in the data files' record
    tables) and the total bytes of its records."""
    return {
        **{k: v for k, v in manifest.items() if k != "chunks"},
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "created_unix": time.time(),
        "index": index,
        "total_bytes": total_bytes,
    }


def manifest_checksum(manifest: dict[str, Any]) -> int:
    """crc32c of the canonical JSON (sorted keys, no spaces, ASCII) of every field of ``manifest``
    except ``manifest_crc32c`` itself."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32c"}
    return crc32c(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def sealed_manifest(manifest: dict[str, Any], metadata: bytes | None, where: str) -> bytes:
    """The bytes of ``mfsdp.json`` for ``manifest``: with the checksum of ``metadata`` (the bytes of
    ``.metadata``, when the checkpoint has one) and then of the manifest itself;
    :class:`~mfsdp_ckpt.errors.CorruptCheckpointError` naming ``where`` and the field for a
    manifest its readers would refuse (a writer never commits one)."""
    out = json.loads(json.dumps(manifest))  # the values as a reader will see them (tuples: lists, keys: strings)
    out.pop("metadata_crc32c", None)
    if metadata is not None:
        out["metadata_crc32c"] = crc32c(metadata)
    out["format_version"] = FORMAT_VERSION  # the version that carries the checksums
    out["manifest_crc32c"] = manifest_checksum(out)
    # a writer never commits what its readers refuse (they all check the schema first)
    check_manifest(out, where)
    return (json.dumps(out, indent=1, sort_keys=True) + "\n").encode()
