"""Whether a command's output and one of its inputs overlap: the output *is* the input, *lies
inside* it, or *contains* it. The one rule every writer applies before it writes anything
(:func:`~mfsdp_ckpt.storage.staging.check_destination`, an object-store destination, the
``inspect --html`` / ``diff --html`` reports, the trainer's ``--ckpt-dir``, ``--metrics`` and
``--tensorboard``): an output that overlaps an input would write over, into or around what the
command is reading.

Local paths are compared after ``os.path.realpath`` (symbolic links and ``..`` resolved, so a link
to a checkpoint's file is that file); fsspec URLs as strings, ``/`` separated. A local path and a
URL never overlap. Pure path arithmetic: nothing is read or created (what a checkpoint path
makes a reader read, a ``latest`` pointer followed, is :func:`mfsdp_ckpt.read.inputs.checkpoint_inputs`).
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.storage.paths import is_url

__all__ = ["IS", "INSIDE", "CONTAINS", "ALL", "overlap", "check_apart"]

#: the relations :func:`overlap` names, as they read in a message ("OUT: lies inside the input X")
IS, INSIDE, CONTAINS = "is", "lies inside", "contains"
ALL = (IS, INSIDE, CONTAINS)


def _key(path: str | os.PathLike) -> tuple[bool, str, str]:
    """``(is a URL, the comparable path, its separator)``."""
    p = os.fspath(path)
    if is_url(p):
        return True, p.rstrip("/"), "/"
    return False, os.path.realpath(os.path.abspath(p.removeprefix("file://"))), os.sep


def overlap(out: str | os.PathLike, src: str | os.PathLike) -> str | None:
    """How ``out`` relates to ``src``: :data:`IS` (the same path), :data:`INSIDE` (``out`` lies
    below ``src``), :data:`CONTAINS` (``src`` lies below ``out``), or None (apart)."""
    (out_url, o, sep), (src_url, s, _) = _key(out), _key(src)
    if out_url != src_url:
        return None
    if o == s:
        return IS
    if o.startswith(s.rstrip(sep) + sep):
        return INSIDE
    if s.startswith(o.rstrip(sep) + sep):
        return CONTAINS
    return None


def check_apart(
    out: str | os.PathLike,
    inputs: Mapping[str, str | os.PathLike | Iterable[str | os.PathLike] | None],
    *,
    name: str = "",
    refuse: Iterable[str] = ALL,
) -> None:
    """Refuse (:class:`CheckpointError`, one line) an ``out`` that overlaps one of ``inputs`` in a
    way listed in ``refuse`` (default: is, lies inside or contains it). ``inputs`` maps a label
    (``"the --resume checkpoint"``, ``"the input"``) to a path, a list of paths, or None (absent);
    ``name`` prefixes the output in the message (a flag: ``"--html"``)."""
    refused = set(refuse)
    for label, paths in inputs.items():
        if paths is None:
            continue
        for src in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
            relation = overlap(out, src)
            if relation in refused:
                shown = f"{name} {os.fspath(out)}" if name else os.fspath(out)
                raise CheckpointError(f"{shown}: {relation} {label} {os.fspath(src)}; write it elsewhere")
