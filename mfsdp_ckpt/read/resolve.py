"""What a path names, without ``torch.distributed.checkpoint``: a checkpoint directory, a ``latest``
pointer to one, or a run directory holding one (:func:`resolve_checkpoint`); a Megatron-Core
checkpoint (:func:`is_mcore`). :mod:`mfsdp_ckpt.read.locate` re-exports them beside the readers. The
launcher's pre-flight and ``import mfsdp_ckpt`` resolve a ``--resume`` path through here before any
rank starts, and DCP (with DTensor and sympy under it) costs about 0.5 s to import."""

from __future__ import annotations

import json
import os

from mfsdp_ckpt.errors import ConversionError, NotACheckpointError
from mfsdp_ckpt.format.names import LATEST_NAME, MCORE_METADATA_NAME, METADATA_NAME
from mfsdp_ckpt.storage import fs

__all__ = ["resolve_checkpoint", "read_pointer", "is_mcore", "read_small_file", "MAX_POINTER_BYTES", "MAX_SMALL_FILE"]

MAX_SMALL_FILE = 64 << 20  # an MCore checkpoint's metadata.json and common.pt: small files; refuse anything larger


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A checkpoint directory from ``path`` (a local path or an fsspec URL): the directory
    itself, a ``latest`` pointer file, or a run directory holding one."""
    path = fs.normalize(path)
    if fs.isfile(path):
        kind = _single_file_kind(path)
        if kind is not None:
            raise NotACheckpointError(f"{path}: {kind[0]}, not a checkpoint directory; {kind[1]}")
        return fs.join(fs.dirname(path), read_pointer(path))
    if not fs.isdir(path):
        raise NotACheckpointError(f"{path}: no such checkpoint")
    if not fs.exists(fs.join(path, METADATA_NAME)) and fs.isfile(fs.join(path, LATEST_NAME)):
        return resolve_checkpoint(fs.join(path, LATEST_NAME))
    return path


MAX_POINTER_BYTES = 4096


def _single_file_kind(path: str) -> tuple[str, str] | None:
    """What a file given where a checkpoint directory was expected is, and the command that
    takes it, when it is a safetensors file or a ``torch.save`` file (by its first bytes); None
    otherwise (a ``latest`` pointer, or something else the pointer reader refuses)."""
    try:
        with fs.open_regular(path) as f:
            head = f.read(16)
    except OSError:
        return None
    make = f"'mfsdp-ckpt convert --to dcp {path} DST' makes a checkpoint of it"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "a torch.save file", make
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return "a safetensors file", make + " ('mfsdp-ckpt import-hf' takes a Hugging Face model directory)"
    return None


def read_pointer(path: str) -> str:
    """The checkpoint name a ``latest`` pointer file holds: one line naming a sibling directory
    (no ``/``, not hidden, printable), read from a regular file only and at most
    :data:`MAX_POINTER_BYTES` of it; :class:`NotACheckpointError` otherwise."""
    try:
        with fs.open_regular(path) as f:
            data = fs.read_bounded(f, MAX_POINTER_BYTES)
    except OSError as e:
        raise NotACheckpointError(f"{path}: unreadable '{LATEST_NAME}' pointer ({e.strerror or e})") from None
    name = data.decode(errors="replace").strip()
    if (
        len(data) > MAX_POINTER_BYTES
        or not name
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or not name.isprintable()
    ):
        raise NotACheckpointError(f"{path}: not a valid '{LATEST_NAME}' pointer")
    return name


def is_mcore(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Megatron-Core ``dist_checkpointing`` directory (it has a
    ``metadata.json`` naming a ``sharded_backend``). Cheap; reads nothing else."""
    try:
        directory = fs.normalize(path)
        if not fs.is_local(directory) or not fs.isdir(directory):
            return False
        meta = fs.join(directory, MCORE_METADATA_NAME)
        if not fs.isfile(meta):
            return False
        return "sharded_backend" in json.loads(read_small_file(meta, MCORE_METADATA_NAME))
    except (ConversionError, ValueError, OSError, TypeError):
        return False


def read_small_file(path: str, what: str) -> bytes:
    """The bytes of a small regular file (at most :data:`MAX_SMALL_FILE`): ConversionError naming
    it otherwise."""
    try:
        with fs.open_regular(path) as f:
            data = fs.read_bounded(f, MAX_SMALL_FILE)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if len(data) > MAX_SMALL_FILE:
        raise ConversionError(f"{path}: {what} larger than {MAX_SMALL_FILE} bytes")
    return data
