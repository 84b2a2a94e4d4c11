"""What a path names: a checkpoint directory, a ``latest`` pointer, or a run directory holding one
(:func:`resolve_checkpoint`, from :mod:`mfsdp_ckpt.read.resolve`, which needs no DCP); and a
checkpoint opened for reading with everything it says about itself checked first
(:func:`open_checkpoint`). Every reader and tool starts here."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from mfsdp_ckpt.errors import NotACheckpointError
from mfsdp_ckpt.format.names import DATA_FILE_SUFFIX, METADATA_NAME
from mfsdp_ckpt.read.dcp_reader import VerifyingReader
from mfsdp_ckpt.read.manifest import is_committed, read_manifest
from mfsdp_ckpt.read.resolve import (
    MAX_POINTER_BYTES,
    MAX_SMALL_FILE,
    is_mcore,
    read_pointer,
    read_small_file,
    resolve_checkpoint,
)
from mfsdp_ckpt.storage import fs

__all__ = [
    "resolve_checkpoint",
    "read_pointer",
    "open_checkpoint",
    "chunk_table",
    "is_mcore",
    "read_small_file",
    "MAX_POINTER_BYTES",
    "MAX_SMALL_FILE",
]


def open_checkpoint(path: str) -> tuple[str, dict[str, Any] | None, Metadata, VerifyingReader]:
    """(directory, manifest or None, DCP metadata read safely and checked, a verifying reader)
    for ``path``; the manifest is checked against its checksum and schema, ``.metadata`` against
    the manifest's checksum of it and :func:`~mfsdp_ckpt.read.metadata_check.checked_metadata`."""
    directory = resolve_checkpoint(path)
    if not fs.lexists(fs.join(directory, METADATA_NAME)):  # anything else there is refused when read
        if fs.isdir(directory) and any(n.endswith(DATA_FILE_SUFFIX) for n in fs.listdir(directory)):
            raise NotACheckpointError(f"{directory}: no .metadata: the save did not finish")
        if _is_hf_model_dir(directory):
            raise NotACheckpointError(
                f"{directory}: a Hugging Face model directory (config.json, *.safetensors), not a checkpoint; "
                f"'mfsdp-ckpt import-hf {directory} OUT' makes a checkpoint of it"
            )
        raise NotACheckpointError(f"{directory}: not a checkpoint (no .metadata)")
    manifest = read_manifest(directory) if is_committed(directory) else None
    reader = VerifyingReader(directory, manifest)
    metadata = reader.read_metadata()
    return directory, manifest, metadata, reader


def chunk_table(path: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """Every stored chunk of the checkpoint at ``path`` by chunk id (``key`` or ``key@o0,o1,…``):
    its file, offset, length and crc32c, from the manifest's chunk table or, for a save's
    checkpoint, its index and record tables. None for a stock DCP checkpoint (no checksums)."""
    _, _, _, reader = open_checkpoint(os.fspath(path))
    return dict(reader.manifest_chunks) if reader.manifest_chunks is not None else None


def _is_hf_model_dir(directory: str) -> bool:
    """Whether ``directory`` looks like a Hugging Face model directory: a ``config.json`` beside
    ``*.safetensors`` files (what ``import-hf`` takes), so a checkpoint command can name it."""
    try:
        names = fs.listdir(directory) if fs.isdir(directory) else []
    except OSError:
        return False
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)
