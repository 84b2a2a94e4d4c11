"""Reading the sidecar manifest ``mfsdp.json``: human-readable, never pickled. Its presence marks a
committed checkpoint; it records the writer's layout (its placement plan), the model config, the
step, versions, time, and a crc32c for every chunk's payload (its fields are built in
:mod:`mfsdp_ckpt.format.manifest`, written by :mod:`mfsdp_ckpt.write.manifest`).

The manifest protects itself and ``.metadata``: ``manifest_crc32c`` is the crc32c of the canonical
JSON of every other field (:func:`~mfsdp_ckpt.format.manifest.manifest_checksum`),
``metadata_crc32c`` the crc32c of the bytes of ``.metadata``. Both are written by
:func:`~mfsdp_ckpt.write.manifest.write_manifest`; :func:`read_manifest` refuses a
manifest whose checksum does not match, and the metadata readers refuse a ``.metadata`` whose
bytes do not. Manifests of format version 1 were written before these fields existed: they still
load, and :func:`is_protected` says they are unprotected (``verify`` and ``inspect`` report it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from mfsdp_ckpt.errors import CorruptCheckpointError, UncommittedCheckpointError
from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.format.manifest import FORMAT, FORMAT_VERSION, manifest_checksum
from mfsdp_ckpt.format.manifest_schema import check_manifest
from mfsdp_ckpt.format.names import MANIFEST_NAME, shown
from mfsdp_ckpt.storage import fs

if TYPE_CHECKING:  # a manifest's readers (the launcher's pre-flight, `ls`) import no torch; its plan's do
    import torch

    from mfsdp_core.plan import ModelPlan

__all__ = [
    "MAX_MANIFEST_BYTES",
    "recorded_plan",
    "read_manifest",
    "is_committed",
    "is_protected",
    "metadata_checksum_problem",
]

MAX_MANIFEST_BYTES = 1 << 30  # a manifest lists every chunk once (about 150 bytes each)


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
