"""Where a report may be written: never over, into or around a checkpoint it reads (its
``mfsdp.json``, a data file, the ``latest`` pointer it followed, its directory or one holding it),
nor over the run the checkpoint belongs to (the run directory's ``latest`` pointer and link, and
every other committed checkpoint there: what a page over them would break is the run's resume),
and only to a regular file or a new path: not a directory, a symbolic link, a FIFO or a device.
Checked before anything is read or written, so a refused report changes nothing."""

from __future__ import annotations

import os
import stat
from typing import Iterable

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME, MANIFEST_NAME
from mfsdp_ckpt.read.inputs import checkpoint_inputs
from mfsdp_ckpt.storage.overlap import check_apart
from mfsdp_ckpt.storage.paths import is_url

__all__ = ["check_report_file", "check_report_out"]


def check_report_file(out: str | os.PathLike, flag: str = "") -> None:
    """Refuse an ``out`` that exists and is not a regular file: a directory, a symbolic link (the
    page would land wherever it points), a FIFO, a socket or a device. ``flag`` (``--html``)
    prefixes the path in the message."""
    path = os.fspath(out)
    shown = f"{flag} {path}" if flag else path
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"{shown}: cannot write the report: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{shown}: is a directory; give the report's file name")
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{shown}: is a symbolic link; give the file itself")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{shown}: is not a regular file (a FIFO, socket or device); give a file name")


def check_report_out(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], flag: str = "") -> None:
    """Refuse (one line naming ``flag`` and the input) an ``out`` that is, lies inside or
    contains a checkpoint the report reads (``inputs``, as given on the command line; a ``latest``
    pointer or run directory is followed), or that :func:`check_report_file` refuses."""
    read = [p for src in inputs for p in checkpoint_inputs(src)]
    check_apart(out, {"the input": read}, name=flag)
    check_apart(out, {"the run of the input": run_entries(read)}, name=flag, refuse=("is", "lies inside"))
    check_report_file(out, flag)


def run_entries(read: Iterable[str]) -> list[str]:
    """What the run directories holding the checkpoints ``read`` keep for their runs: the
    ``latest`` pointer and ``latest-checkpoint`` link, and every committed checkpoint (a directory
    holding ``mfsdp.json``, bases included); local paths only (an object store's prefix is left to
    its own refusals). An output must be none of them and lie inside none."""
    out: list[str] = []
    for path in read:
        if is_url(path) or not os.path.isdir(path):
            continue
        run = os.path.dirname(os.path.abspath(path))
        out += [os.path.join(run, LATEST_NAME), os.path.join(run, LATEST_LINK_NAME)]
        try:
            names = os.listdir(run)
        except OSError:
            continue
        for name in names:
            entry = os.path.join(run, name)
            if not os.path.islink(entry) and os.path.lexists(os.path.join(entry, MANIFEST_NAME)):
                out.append(entry)
    return out
