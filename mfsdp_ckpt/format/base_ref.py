"""A checkpoint's reference to its base: the checkpoint of a run that holds its frozen weights.

A run whose model has frozen parameters (LoRA, frozen embeddings) writes those weights once, into
a base checkpoint beside its saves (``<run>/base_step_000010``); every save of the run then holds
the trainable parameters, their optimizer state and the run's state, and records in its manifest
a ``base`` field naming the base. A base is a committed checkpoint of its own (its manifest says
``"role": "base"``). The reference pins it three ways, all checked by every reader:

- ``name``: a sibling directory of the referencing checkpoint (one path component, never ``..``,
  never hidden; a link there is refused when opened);
- ``save_id`` and ``manifest_crc32c``: the base's own, so another save under the same name, or a
  manifest changed since, is refused;
- ``id``: the base's content id (:func:`content_id`): a digest of its index, which through the
  record tables' checksums covers every byte of its chunks.

Pure functions of values (no I/O): the writer builds the record, the readers check it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from mfsdp_ckpt.format.names import member_name_problem

__all__ = [
    "BASE_ROLE",
    "BASE_PREFIX",
    "base_name",
    "content_id",
    "is_base",
    "reference_to",
    "reference_problem",
    "name_problem",
    "base_file",
    "split_base_file",
    "shown_file",
]

BASE_ROLE = "base"
BASE_PREFIX = "base_"


def base_name(step: int | None, save_name: str) -> str:
    """The directory name of a base written with the save ``save_name`` (at ``step``)."""
    return f"{BASE_PREFIX}step_{step:06d}" if step is not None else f"{BASE_PREFIX}{save_name}"


def is_base(manifest: dict[str, Any] | None) -> bool:
    """Whether a manifest is a base checkpoint's (frozen weights that saves reference)."""
    return bool(manifest) and manifest.get("role") == BASE_ROLE


def content_id(manifest: dict[str, Any]) -> str:
    """The content id of a base: sha256 of the canonical JSON of its index (its key table, its
    layout and every data file's size and record-table crc32c, which holds each chunk's crc32c)."""
    body = json.dumps(manifest.get("index"), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(body.encode()).hexdigest()


def reference_to(name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The ``base`` field of a save that references the committed base ``name`` (its manifest)."""
    return {
        "name": name,
        "id": content_id(manifest),
        "save_id": manifest.get("save_id"),
        "manifest_crc32c": manifest.get("manifest_crc32c"),
    }


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a base (None: it can): one path component inside the run
    directory, not hidden."""
    problem = member_name_problem(name)
    if problem is not None:
        return problem
    if "/" in name or "\\" in name:
        return f"'{name}' is not one path component (a base is a directory of the run itself)"
    if name.startswith("."):
        return f"'{name}' is hidden (a staging directory or the run's lock)"
    return None


def reference_problem(reference: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """Why the committed checkpoint with ``manifest`` is not the base ``reference`` pins (None:
    it is)."""
    if not is_base(manifest):
        return "not a base checkpoint (its manifest has no role 'base')"
    if manifest.get("save_id") != reference["save_id"]:
        return "another save than the one referenced (save_id differs): the base was replaced"
    if manifest.get("manifest_crc32c") != reference["manifest_crc32c"]:
        return "its manifest differs from the one referenced (manifest_crc32c): the base was changed"
    if content_id(manifest) != reference["id"]:
        return "its content id differs from the referenced one: the base was changed"
    return None


_FILE_MARK = "<base:"


def base_file(name: str, file: str) -> str:
    """How a referencing checkpoint's readers name the data file ``file`` of its base ``name``:
    a form no stored file name can take (it holds ``/``), resolved by the chunk reader to the
    sibling directory."""
    return f"{_FILE_MARK}{name}>/{file}"


def split_base_file(relative_path: str) -> tuple[str, str] | None:
    """(base name, file) of a :func:`base_file` name; None for a checkpoint's own file."""
    if not relative_path.startswith(_FILE_MARK):
        return None
    name, sep, file = relative_path[len(_FILE_MARK) :].partition(">/")
    return (name, file) if sep else None


def shown_file(relative_path: str) -> str:
    """A data file's name for a person: ``base_step_000010/__0_0.distcp`` for a base's file."""
    split = split_base_file(relative_path)
    return f"{split[0]}/{split[1]}" if split is not None else relative_path
