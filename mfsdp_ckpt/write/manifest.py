"""Committing a checkpoint's manifest: ``mfsdp.json`` written last, whose presence marks the
checkpoint committed. Its fields and checksums are built in :mod:`mfsdp_ckpt.format.manifest`;
this module only puts the bytes in place."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.format.manifest import sealed_manifest
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME
from mfsdp_ckpt.storage import fs

__all__ = ["write_manifest"]


def write_manifest(directory: str, manifest: dict[str, Any], sync: bool = True) -> None:
    """Write ``mfsdp.json`` in ``directory`` (local: via a temporary file and a rename; object
    store: one upload), with the checksum of ``.metadata`` (when it is already in ``directory``,
    as every writer leaves it) and then of the manifest itself; :class:`~mfsdp_ckpt.errors.CorruptCheckpointError`
    naming the field, and nothing written, for a manifest its readers would refuse."""
    metadata = fs.join(directory, METADATA_NAME)
    data = fs.read_bytes(metadata) if fs.isfile(metadata) else None
    text = sealed_manifest(manifest, data, f"{fs.join(directory, MANIFEST_NAME)} (not committed)")
    fs.write_bytes(fs.join(directory, MANIFEST_NAME), text, sync=sync)
