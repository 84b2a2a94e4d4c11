"""Write-then-rename, in one place for every writer (``save``, ``reshard``, ``convert``,
``import-hf``, ``export-hf``).

A writer fills a hidden sibling of its final path, ``.<name>.partial-<token>``, and makes it
visible with one ``rename``: readers see all of it or nothing, and a writer that dies leaves only
the ``.partial-`` sibling (``mfsdp-ckpt ls`` lists it as uncommitted). The token tells concurrent
writers' siblings apart; collective writers agree on one token first.

Local paths only: an object store has no rename (there the manifest, written last, commits; see
:mod:`mfsdp_ckpt.fs`).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid

from .errors import CheckpointExistsError

__all__ = ["PARTIAL_MARK", "new_token", "partial_path", "is_partial_name", "make_partial_dir", "fsync_dir",
           "commit_directory", "write_file_atomic"]

PARTIAL_MARK = ".partial-"


def new_token() -> str:
    """A fresh token (12 hex digits) for one write's partial sibling."""
    return uuid.uuid4().hex[:12]


def partial_path(final: str, token: str) -> str:
    """The partial sibling of ``final`` for ``token``: ``<parent>/.<name>.partial-<token>``."""
    final = os.path.abspath(final)
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{PARTIAL_MARK}{token}")


def is_partial_name(name: str) -> bool:
    """Whether a directory entry's name is a partial sibling (written, never committed)."""
    return PARTIAL_MARK in name


def make_partial_dir(final: str) -> str:
    """Create a fresh, empty partial sibling directory of ``final`` (and any missing parent)
    and return its path; ``OSError`` if it cannot be created."""
    tmp = partial_path(final, new_token())
    os.makedirs(tmp)
    return tmp


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_directory(tmp_dir: str, final_dir: str, *, overwrite: bool) -> None:
    """Make ``tmp_dir`` visible as ``final_dir`` with one rename. An existing ``final_dir`` is
    replaced only with ``overwrite``; it is moved aside first, so one of the two always exists."""
    parent = os.path.dirname(os.path.abspath(final_dir))
    old = None
    if os.path.exists(final_dir):
        if not overwrite:
            raise CheckpointExistsError(f"{final_dir}: already exists (pass overwrite=True to replace it)")
        old = os.path.join(parent, f".{os.path.basename(final_dir)}.replaced-{os.getpid()}-{time.time_ns()}")
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_file_atomic(path: str, data: bytes | bytearray | memoryview, *, sync: bool = True) -> None:
    """``data`` at ``path``, all or nothing: written to a partial sibling, then renamed over
    ``path`` (an existing file is replaced). With ``sync`` the file and the rename are durable
    when it returns. On failure the partial sibling is removed and ``path`` is as it was."""
    tmp = partial_path(path, new_token())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
