"""The manifest of the base a checkpoint references, found and checked against the reference
(:mod:`mfsdp_ckpt.format.base_ref`), without torch: the launcher's pre-flight and the size guards
read it before any rank starts; :mod:`mfsdp_ckpt.read.base` builds the readers' view on it."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from mfsdp_ckpt.format.base_ref import name_problem, reference_problem
from mfsdp_ckpt.format.names import MANIFEST_NAME
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs

__all__ = ["checked_base", "stored_bytes"]


def checked_base(directory: str, manifest: dict[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """``(base directory, base manifest)`` of the base that the checkpoint in ``directory`` (its
    ``manifest``) references, checked against the reference; None when it references none.
    One-line errors name the base: missing, a link, not committed, not the base the reference pins
    (replaced or changed), or one that references a base itself."""
    reference = (manifest or {}).get("base")
    if reference is None:
        return None
    name = reference["name"]
    problem = name_problem(name)  # the schema checked it too: a reader never trusts one check
    if problem is not None:
        raise UnsafeCheckpointError(f"{fs.join(directory, MANIFEST_NAME)}: field 'base.name': {problem}")
    base = fs.join(fs.dirname(directory), name)
    if fs.islink(base):
        raise UnsafeCheckpointError(f"{base}: the base of {directory} is a link; a base must be a directory of the run")
    if not fs.isdir(base):
        raise CorruptCheckpointError(
            f"{base}: missing: the base checkpoint (frozen weights) that {directory} references"
        )
    try:
        base_manifest = read_manifest(base)
    except CheckpointError as e:
        raise type(e)(f"{e} (the base that {directory} references)") from None
    problem = reference_problem(reference, base_manifest)
    if problem is None and "index" not in base_manifest:
        problem = "it has no index"
    if problem is not None:
        raise CorruptCheckpointError(f"{base}: {problem} (the base that {directory} references)")
    if base_manifest.get("base") is not None:
        raise CorruptCheckpointError(f"{base}: references a base itself; a base holds its weights")
    return base, base_manifest


def stored_bytes(directory: str, manifest: dict[str, Any]) -> int | None:
    """The bytes of tensors the checkpoint in ``directory`` holds for its readers: its own data
    files' (the manifest's ``total_bytes``) and, when it references a base, the base's too (checked
    as every reader checks it: a base that fails the check raises its one-line error). None when
    the manifest records no total."""
    own = manifest.get("total_bytes")
    if type(own) is not int:
        return None
    found = checked_base(directory, manifest)
    if found is None:
        return own
    base_total = found[1].get("total_bytes")
    return own + base_total if type(base_total) is int else own
