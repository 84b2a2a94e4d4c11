"""The sidecar manifest ``mfsdp.json``: human-readable, never pickled. Its presence marks a
committed checkpoint; it records the writer's layout (its placement plan), the model config, the
step, versions, time, and a crc32c for every chunk's payload.

The manifest protects itself and ``.metadata``: ``manifest_crc32c`` is the crc32c of the canonical
JSON of every other field (:func:`manifest_checksum`), ``metadata_crc32c`` the crc32c of the bytes
of ``.metadata``. Both are written by :func:`write_manifest`; :func:`read_manifest` refuses a
manifest whose checksum does not match, and the metadata readers refuse a ``.metadata`` whose
bytes do not. Manifests of format version 1 were written before these fields existed: they still
load, and :func:`is_protected` says they are unprotected (``verify`` and ``inspect`` report it).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable

from mfsdp_ckpt.errors import CorruptCheckpointError, UncommittedCheckpointError
from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.format.manifest_schema import check_manifest
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, shown
from mfsdp_ckpt.storage import fs

if TYPE_CHECKING:  # a manifest's readers (the launcher's pre-flight, `ls`) import no torch; its plan's do
    import torch

    from mfsdp_core.plan import ModelPlan

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "completed",
    "indexed",
    "versions",
    "writer_layout",
    "recorded_plan",
    "read_manifest",
    "write_manifest",
    "is_committed",
    "is_protected",
    "manifest_checksum",
    "metadata_checksum_problem",
]

FORMAT = "mfsdp-ckpt"
# 3: a save's manifest holds an index of its layout instead of every chunk (``chunks`` remains
# for the offline tools' checkpoints); 2: the manifest carries manifest_crc32c (and
# metadata_crc32c); 1: it does not
FORMAT_VERSION = 3
MAX_MANIFEST_BYTES = 1 << 30  # a manifest lists every chunk once (about 150 bytes each)


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


def recorded_plan(
    manifest: dict[str, Any],
    shape_of: Callable[[str], torch.Size | None],
    dtype_of: Callable[[str], torch.dtype | None],
    source: str = MANIFEST_NAME,
) -> ModelPlan | None:
    """The placement plan the writer recorded, or None when it recorded none. Manifests written
    before the plan existed list ``writer.groups`` (parameters, strategy, policy, group size);
    their shapes and dtypes come from the checkpoint's tensors (``shape_of`` / ``dtype_of`` of a
    parameter name). A plan that the manifest schema admits but that does not make a
    :class:`ModelPlan` is a :class:`CorruptCheckpointError` naming ``source``."""
    writer = manifest.get("writer") or {}
    try:
        return _recorded_plan(writer, shape_of, dtype_of)
    except (KeyError, TypeError, ValueError) as e:
        field = "writer.plan" if "plan" in writer else "writer.groups"
        raise CorruptCheckpointError(
            f"{source}: field '{field}': not a placement plan ({type(e).__name__}: {shown(str(e), 160)})"
        ) from None


def _recorded_plan(
    writer: dict[str, Any], shape_of: Callable[[str], torch.Size | None], dtype_of: Callable[[str], torch.dtype | None]
) -> ModelPlan | None:
    import torch

    from mfsdp_core.dtypes import dtype_name
    from mfsdp_core.plan import DEFAULT_GROUP, ModelPlan

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
        buffers.append(
            {
                "params": names,
                "shapes": [list(s) if s is not None else None for s in shapes],
                "dtype": dtype_name(dtype),
                "strategy": g["strategy"],
                "policy": g["policy"],
                "group_size": g["group_size"] if shards else world,
                "is_expert": g.get("is_expert", False),
            }
        )
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
    return {
        **{k: v for k, v in manifest.items() if k != "index"},  # a source's index does not describe these chunks
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


def write_manifest(directory: str, manifest: dict[str, Any], sync: bool = True) -> None:
    """Write ``mfsdp.json`` in ``directory`` (local: via a temporary file and a rename; object
    store: one upload), with the checksum of ``.metadata`` (when it is already in ``directory``,
    as every writer leaves it) and then of the manifest itself; :class:`CorruptCheckpointError`
    naming the field, and nothing written, for a manifest its readers would refuse."""
    out = json.loads(json.dumps(manifest))  # the values as a reader will see them (tuples: lists, keys: strings)
    out.pop("metadata_crc32c", None)
    metadata = fs.join(directory, METADATA_NAME)
    if fs.isfile(metadata):
        out["metadata_crc32c"] = crc32c(fs.read_bytes(metadata))
    out["format_version"] = FORMAT_VERSION  # the version that carries the checksums
    out["manifest_crc32c"] = manifest_checksum(out)
    # a writer never commits what its readers refuse (they all check the schema first)
    check_manifest(out, f"{fs.join(directory, MANIFEST_NAME)} (not committed)")
    text = json.dumps(out, indent=1, sort_keys=True) + "\n"
    fs.write_bytes(fs.join(directory, MANIFEST_NAME), text.encode(), sync=sync)


def is_committed(directory: str) -> bool:
    """Whether ``directory`` holds a manifest (anything under its name, even a FIFO or a dangling
    symlink: :func:`read_manifest` then says what is wrong with it)."""
    return fs.lexists(fs.join(directory, MANIFEST_NAME))


def is_protected(manifest: dict[str, Any]) -> bool:
    """Whether the manifest carries its own checksum (format version 2 on): one written before
    that existed still loads, but nothing protects its fields or ``.metadata``."""
    return "manifest_crc32c" in manifest


def metadata_checksum_problem(manifest: dict[str, Any] | None, data: bytes) -> str | None:
    """Why the bytes ``data`` of ``.metadata`` are not the ones the manifest recorded (None: they
    are, or the manifest recorded none)."""
    expected = (manifest or {}).get("metadata_crc32c")
    if expected is None or crc32c(data) == expected:
        return None
    return "checksum mismatch with the manifest's metadata_crc32c (.metadata was changed after the save)"


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a committed checkpoint (local path or fsspec URL), checked against its own
    checksum and :func:`~mfsdp_ckpt.format.manifest_schema.check_manifest`'s schema; raises
    :class:`UncommittedCheckpointError` if it is missing, :class:`CorruptCheckpointError` (one
    line naming the file and the field) if it is not a sound manifest of ours."""
    path = fs.join(directory, MANIFEST_NAME)
    if not is_committed(directory):
        raise UncommittedCheckpointError(
            f"{directory}: no committed manifest ({MANIFEST_NAME}); the save did not finish or this is not an mfsdp checkpoint"
        )
    try:
        manifest = json.loads(fs.read_member(directory, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES))
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: unreadable manifest ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{path}: unreadable manifest ({type(e).__name__}: {shown(str(e), 120)})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not an {FORMAT} manifest")
    version = manifest.get("format_version", 0)
    if type(version) is not int or version < 0:
        raise CorruptCheckpointError(f"{path}: field 'format_version': expected a non-negative integer")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: format version {version} is newer than this reader ({FORMAT_VERSION})")
    if "manifest_crc32c" in manifest or version >= 2:
        try:
            actual = manifest_checksum(manifest)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{path}: unreadable manifest ({type(e).__name__})") from None
        if manifest.get("manifest_crc32c") != actual:
            what = "missing" if "manifest_crc32c" not in manifest else "does not match its contents"
            raise CorruptCheckpointError(
                f"{path}: field 'manifest_crc32c': {what} (the manifest was changed after the save)"
            )
    check_manifest(manifest, path)
    return manifest
