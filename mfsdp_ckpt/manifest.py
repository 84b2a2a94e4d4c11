"""The sidecar manifest ``mfsdp.json``: human-readable, never pickled. Its presence marks a
committed checkpoint; it records the writer's layout, the model config, the step, versions, time,
and a crc32c for every chunk's payload."""

from __future__ import annotations

import json
from typing import Any

from . import fs
from .errors import CorruptCheckpointError, UncommittedCheckpointError

__all__ = ["MANIFEST_NAME", "FORMAT", "FORMAT_VERSION", "read_manifest", "write_manifest", "is_committed"]

MANIFEST_NAME = "mfsdp.json"
FORMAT = "mfsdp-ckpt"
FORMAT_VERSION = 1


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
