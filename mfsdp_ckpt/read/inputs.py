"""What a reader of a checkpoint path reads, as paths an output must keep away from
(:func:`mfsdp_ckpt.storage.overlap.check_apart`): the checkpoint directory the path names, and the
``latest`` pointer followed to it. Without ``torch``: the launcher's pre-flight asks it too."""

from __future__ import annotations

import os

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import LATEST_NAME
from mfsdp_ckpt.read.resolve import resolve_checkpoint
from mfsdp_ckpt.storage.paths import is_url

__all__ = ["checkpoint_inputs", "pointer_inputs"]


def checkpoint_inputs(path: str | os.PathLike) -> list[str]:
    """The paths read through ``path``: the checkpoint directory it names and the ``latest``
    pointer on the way (:func:`pointer_inputs`); ``path`` itself when it names no checkpoint
    directory (a ``.pt`` file, an MCore or HF directory, a missing path), which the command's
    reader reads as it is or refuses."""
    given = os.fspath(path)
    try:
        return pointer_inputs(given, resolve_checkpoint(given))
    except (CheckpointError, OSError, ValueError):
        return [given]


def pointer_inputs(given: str, resolved: str) -> list[str]:
    """What a reader of ``given`` reads once it has followed it to the checkpoint directory
    ``resolved``: that directory, and the ``latest`` pointer on the way when there was one
    (``given`` itself when it is the pointer file, ``given/latest`` when it is a run directory). A
    run directory is not itself an input: its other entries are not read."""
    if os.fspath(given).rstrip("/") == os.fspath(resolved).rstrip("/") or (
        not is_url(given) and os.path.realpath(given) == os.path.realpath(resolved)
    ):
        return [resolved]
    if is_url(given):
        given = given.rstrip("/")
        pointer = given if given.endswith("/" + LATEST_NAME) else f"{given}/{LATEST_NAME}"
    else:
        pointer = os.path.join(given, LATEST_NAME) if os.path.isdir(given) else given
    return [pointer, resolved]
