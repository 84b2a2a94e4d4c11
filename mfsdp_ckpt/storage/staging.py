"""Write-then-rename, in one place for every writer (``save``, ``reshard``, ``convert``,
``import-hf``, ``export-hf``).

A writer fills a hidden sibling of its final path, ``.<name>.partial-<token>``, and makes it
visible with one ``rename``: readers see all of it or nothing, and a writer that dies leaves only
the ``.partial-`` sibling (``mfsdp-ckpt ls`` lists it as uncommitted). The token tells concurrent
writers' siblings apart; collective writers agree on one token first.

Local paths only: an object store has no rename (there the manifest, written last, commits; see
:mod:`mfsdp_ckpt.storage.fs`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from typing import Sequence

from mfsdp_ckpt.errors import CheckpointError, CheckpointExistsError, shown_list
from mfsdp_ckpt.format.names import (
    LATEST_NAME,
    MANIFEST_NAME,
    METADATA_NAME,
    PARTIAL_MARK,
    REPLACED_MARK,
)
from mfsdp_ckpt.storage.overlap import CONTAINS, INSIDE, IS, check_apart, overlap
from mfsdp_ckpt.storage.paths import is_url
from mfsdp_ckpt.storage.write_errors import write_failed

__all__ = [
    "new_token",
    "partial_path",
    "is_partial_name",
    "make_partial_dir",
    "fsync_dir",
    "commit_directory",
    "write_file_atomic",
    "check_destination",
    "refuse_replacing_a_source",
    "remove_leftovers",
]


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


def _is_leftover(name: str) -> bool:
    return name.startswith(".") and (PARTIAL_MARK in name or REPLACED_MARK in name)


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
        old = os.path.join(parent, f".{os.path.basename(final_dir)}{REPLACED_MARK}{os.getpid()}-{time.time_ns()}")
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
        if sync:
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException as e:
        if os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise write_failed(e, path) from None
        raise


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME)) or os.path.isfile(os.path.join(path, METADATA_NAME))


def _is_hf_dir(path: str) -> bool:
    names = os.listdir(path)
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def check_destination(final: str, *, overwrite: bool, kind: str, sources: tuple[str, ...] = ()) -> None:
    """Refuse a destination whose writing would lose data, before anything is written.

    ``final`` must not lie inside a source, and must not exist unless ``overwrite``; an existing
    one is replaced only when it is empty or what the writer writes (``kind``: ``"checkpoint"``, a
    DCP checkpoint directory; ``"hf"``, a Hugging Face model directory; ``"file"``, a regular
    file), is not a symbolic link, contains no source, and holds no other checkpoint (a run
    directory). For a local destination; one on an object store is checked where it is written
    (:mod:`mfsdp_ckpt.storage.objstore`), and a source there cannot overlap a local one."""
    if is_url(final):
        return
    sources = tuple(s for s in sources if not is_url(s))
    final = os.path.abspath(final)
    if os.path.lexists(final) and not overwrite:
        raise CheckpointExistsError(f"{final}: already exists (use --overwrite / overwrite=True to replace it)")
    check_apart(final, {"the source": sources}, refuse=(INSIDE,))
    if not os.path.lexists(final):
        return
    what = {"checkpoint": "a checkpoint directory", "hf": "a Hugging Face model directory", "file": "a regular file"}[
        kind
    ]
    if os.path.islink(final):
        raise CheckpointError(f"{final}: is a symbolic link; refusing to replace it (give the path it points to)")
    refuse_replacing_a_source(final, sources)
    if kind == "file":
        if not os.path.isfile(final):
            raise CheckpointError(f"{final}: is not {what}; refusing to replace it")
        return
    if os.path.isdir(final) and not os.listdir(final):
        return  # an empty directory: nothing to lose
    if os.path.isdir(final):
        others = sorted(
            n
            for n in os.listdir(final)
            if os.path.isdir(os.path.join(final, n)) and _is_checkpoint_dir(os.path.join(final, n))
        )
        if others or os.path.isfile(os.path.join(final, LATEST_NAME)):
            held = shown_list(others, 3) if others else "a 'latest' pointer"
            raise CheckpointError(f"{final}: holds other checkpoints ({held}): a run directory; refusing to replace it")
    if not os.path.isdir(final) or not (_is_checkpoint_dir(final) if kind == "checkpoint" else _is_hf_dir(final)):
        raise CheckpointError(f"{final}: is not {what}; refusing to replace it")


def refuse_replacing_a_source(final: str, sources: Sequence[str]) -> None:
    """Refuse replacing ``final`` when it is or contains one of ``sources`` (local or URLs, as
    :func:`~mfsdp_ckpt.storage.overlap.overlap` compares them): that would delete the source."""
    for src in sources:
        if overlap(final, src) in (IS, CONTAINS):
            raise CheckpointError(f"{final}: contains the source {src}; replacing it would delete the source")


def remove_leftovers(parent: str, keep: Sequence[str] = (), of: str | None = None) -> list[str]:
    """Remove what killed writers left in ``parent``: ``.partial-`` and ``.replaced-`` siblings
    (with ``of``, only those of the destination named ``of``), except the paths in ``keep``. Call
    it only while holding ``parent``'s writer lock (see :mod:`mfsdp_ckpt.storage.lock`), so that
    no live writer's partial is taken. Returns what was removed."""
    removed: list[str] = []
    keep_real = {os.path.realpath(k) for k in keep}
    mine = None if of is None else (f".{of}{PARTIAL_MARK}", f".{of}{REPLACED_MARK}")
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        path = os.path.join(parent, name)
        if not (_is_leftover(name) if mine is None else name.startswith(mine)) or os.path.realpath(path) in keep_real:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(path)
    return removed
