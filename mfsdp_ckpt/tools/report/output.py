"""Where a report may be written: never over, into or around a checkpoint it reads (its
``mfsdp.json``, a data file, the ``latest`` pointer it followed, its directory or one holding it),
and only to a regular file or a new path: not a directory, a symbolic link, a FIFO or a device.
Checked before anything is read or written, so a refused report changes nothing."""

from __future__ import annotations

import os
import stat
from typing import Iterable

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.read.inputs import checkpoint_inputs
from mfsdp_ckpt.storage.overlap import check_apart

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
    check_report_file(out, flag)
