"""Where every writer's output goes: one seam between the writers (``save``, ``async_save``,
``reshard``, ``convert``, ``upcycle``, ``import-hf``, ``import-mcore``, ``export-mcore``,
``export-hf``) and the storage they write to.

:func:`destination_for` decides once whether a path is on this machine's file system or on an
object store and returns a :class:`Destination` whose verbs carry out the commit protocol there:

* :meth:`~Destination.check`: the refusals that protect data (an existing output without
  ``overwrite``, one that is not what the writer writes, one inside or around a source), before
  anything is read or written;
* :meth:`~Destination.open`: the same checks again under the parent's writer lock, what killed
  writers left behind removed, and the staging place made: a hidden ``.partial-`` sibling
  locally; the final prefix itself on an object store (no rename there), after un-committing an
  old checkpoint that ``overwrite`` replaces;
* :meth:`~Destination.commit`: the writer's last file (``mfsdp.json``, an HF index), then locally
  one rename; on an object store that last file is the commit;
* :meth:`~Destination.abort`, :meth:`~Destination.uncommit`, :meth:`~Destination.point_latest`,
  :meth:`~Destination.close` (the lock released), and what files need there
  (:meth:`~Destination.sync_file`, :meth:`~Destination.start_writeback`).

A destination is opened by one process (the job's process 0, or rank 0 of a save), which holds
the lock; the others write into :attr:`~Destination.staging` by its path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import IO, Any, Callable, Sequence

from mfsdp_ckpt.errors import CheckpointError, CheckpointExistsError, ConversionError
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME, MANIFEST_NAME, PARTIAL_MARK
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.lock import check_unlocked, run_lock
from mfsdp_ckpt.storage.overlap import INSIDE, check_apart
from mfsdp_ckpt.storage.staging import (
    check_destination,
    commit_directory,
    fsync_dir,
    make_partial_dir,
    new_token,
    refuse_replacing_a_source,
    remove_leftovers,
)
from mfsdp_ckpt.storage.writeback import start_writeback

__all__ = ["Destination", "LocalDestination", "ObjectStoreDestination", "FileDestination", "destination_for", "KINDS"]

#: what a destination holds: a canonical checkpoint, a Hugging Face model directory, one file
#: (``convert --to torch``), or a run directory (only locked, cleaned and pointed at)
KINDS = ("checkpoint", "hf", "file", "run")

#: the words for what cannot be made in a parent, per kind a local destination stages
_PARENT_WORDS = {
    "checkpoint": "cannot create the checkpoint's parent directory",
    "hf": "cannot create the export's directory there",
}


def destination_for(path: str | os.PathLike, kind: str = "checkpoint") -> "Destination":
    """The destination ``path`` (a local path or an fsspec URL) for output of ``kind``
    (:data:`KINDS`). A Hugging Face directory is written locally only (ConversionError otherwise)."""
    if kind not in KINDS:
        raise ValueError(f"destination kind {kind!r}: expected one of {', '.join(KINDS)}")
    final = fs.normalize(path)
    if kind == "file":
        return FileDestination(final, kind)
    if fs.is_local(final):
        return LocalDestination(final, kind)
    if kind == "hf":
        raise ConversionError(f"{os.fspath(path)}: the HF directory must be a local path (the checkpoint may be a URL)")
    return ObjectStoreDestination(final, kind)


class Destination:
    """One output being written: ``final`` (normalized), of ``kind``. After :meth:`open`,
    :attr:`staging` is where its files go; :attr:`committed` says whether :meth:`commit` ran."""

    def __init__(self, final: str, kind: str) -> None:
        self.final = final
        self.kind = kind
        self.staging: str | None = None
        self.committed = False
        self.overwrite = False  # what open() was told
        self.sync = True
        self._lock = contextlib.ExitStack()

    def __enter__(self) -> "Destination":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.committed:
            self.abort()
        self.close()

    def check(self, *, overwrite: bool = False, sources: Sequence[str] = ()) -> None:
        """Refuse (one line) an output whose writing would lose data, before anything is written."""
        raise NotImplementedError

    def open(
        self, *, overwrite: bool = False, sources: Sequence[str] = (), clean_parent: bool = False, sync: bool = True
    ) -> str:
        """Make the staging place after :meth:`check` (under the parent's lock where there is one,
        held until :meth:`close`), with what killed writers of this output left removed
        (``clean_parent``: of any output of the parent, a run directory's). Returns :attr:`staging`."""
        raise NotImplementedError

    def commit(self, write_last: Callable[[], Any] | None = None) -> str:
        """``write_last()`` (the file that makes the output complete), then make it visible at
        :attr:`final`. Returns :attr:`final`."""
        raise NotImplementedError

    def abort(self) -> None:
        """Remove what was written to :attr:`staging` (best effort) and release the lock; the
        output is as it was (on an object store, an old checkpoint ``overwrite`` replaced is gone)."""
        if self.staging is not None and not self.committed:
            with contextlib.suppress(Exception):
                _remove_checkpoint(self.staging)
        self.close()

    def uncommit(self) -> None:
        """Remove the committed output at :attr:`final`, its manifest first: interrupted, it
        leaves an uncommitted directory, never a complete-looking mix."""
        _remove_checkpoint(self.final)

    def scratch_path(self, tag: str) -> str:
        """A hidden sibling of :attr:`final` for a writer's intermediate output (e.g. a checkpoint
        resharded into the destination afterwards), named like a staging directory so that what a
        killed writer leaves there is removed as one (``ls --clean``, the next write)."""
        return fs.join(fs.dirname(self.final), f".{fs.basename(self.final)}{PARTIAL_MARK}{tag}{new_token()}")

    def point_latest(self) -> None:
        """``<parent>/latest`` names this output (an atomic replace; one PUT on an object store)."""
        parent = fs.dirname(self.final)
        fs.write_bytes(fs.join(parent, LATEST_NAME), (fs.basename(self.final) + "\n").encode())

    def close(self) -> None:
        """Release the parent's lock (if held)."""
        self._lock.close()

    def sync_file(self, f: IO[bytes]) -> None:
        """Make a written file's bytes durable, where that means something."""

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Start writing a file's bytes to disk now, where that means something (a hint)."""

    def free_bytes(self) -> tuple[str, int] | None:
        """(the nearest existing folder, its free bytes); None where the store does not say."""
        return None

    def clean(self) -> list[str]:
        """Remove what killed writers left in this run directory; the paths removed."""
        raise NotImplementedError

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """This run directory's writer lock, held inside ``with`` (where there is one)."""
        return contextlib.nullcontext()

    def probe(self) -> None:
        """Refuse now, not at the first save, a run directory that cannot be written."""

    def check_unlocked(self) -> None:
        """Refuse (RunLockedError) a run directory another live process holds the lock of;
        creates nothing."""

    def staged_siblings(self) -> frozenset[str]:
        """The names of this output's staging siblings there now (``.<name>.partial-*``: a
        writer's, live or killed); none where staging leaves no sibling (an object store)."""
        return frozenset()

    def discard_staging(self, keep: frozenset[str] = frozenset()) -> None:
        """Remove this output's staging siblings but ``keep`` (names), holding the parent's
        writer lock (re-entrant in this process); nothing when another live process holds it
        (it is writing). For a writer interrupted between making its staging directory and
        taking charge of it."""


class LocalDestination(Destination):
    """A path on this machine: staged in a ``.partial-`` sibling, committed by one rename, the
    parent locked while it is written."""

    def check(self, *, overwrite: bool = False, sources: Sequence[str] = ()) -> None:
        check_destination(self.final, overwrite=overwrite, kind=self.kind, sources=tuple(sources))

    def open(
        self, *, overwrite: bool = False, sources: Sequence[str] = (), clean_parent: bool = False, sync: bool = True
    ) -> str:
        parent = os.path.dirname(self.final)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{parent}: {_PARENT_WORDS[self.kind]} ({e.strerror})") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointError(f"{parent}: not writable, cannot save {os.path.basename(self.final)} there")
        self.sync = sync
        self._lock.enter_context(run_lock(parent))
        try:
            self.check(overwrite=overwrite, sources=sources)
            keep = [s for s in sources if not fs.is_url(s)]  # an import reshards from its own partial
            remove_leftovers(parent, keep=keep, of=None if clean_parent else os.path.basename(self.final))
            try:
                staging = make_partial_dir(self.final)
            except OSError as e:
                raise CheckpointError(f"{parent}: {_PARENT_WORDS[self.kind]} ({e.strerror})") from None
        except BaseException:
            self.close()
            raise
        self.overwrite = overwrite
        self.staging = staging
        return staging

    def commit(self, write_last: Callable[[], Any] | None = None) -> str:
        assert self.staging is not None, "commit before open"
        if write_last is not None:
            write_last()
        if self.sync:
            fsync_dir(self.staging)
        commit_directory(self.staging, self.final, overwrite=self.overwrite)
        self.committed = True
        return self.final

    def point_latest(self) -> None:
        super().point_latest()
        _link_latest(os.path.dirname(self.final), os.path.basename(self.final))

    def sync_file(self, f: IO[bytes]) -> None:
        os.fsync(f.fileno())

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        start_writeback(fd, offset, length)

    def free_bytes(self) -> tuple[str, int] | None:
        where = self.final
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        return where, shutil.disk_usage(where).free

    def clean(self) -> list[str]:
        from mfsdp_ckpt.errors import NotACheckpointError

        if not os.path.isdir(self.final):
            raise NotACheckpointError(f"{self.final}: no such directory")
        with run_lock(self.final):
            return remove_leftovers(self.final)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return run_lock(self.final)

    def staged_siblings(self) -> frozenset[str]:
        parent, name = os.path.split(self.final)
        try:
            names = os.listdir(parent)
        except OSError:
            return frozenset()
        return frozenset(n for n in names if n.startswith(f".{name}{PARTIAL_MARK}"))

    def discard_staging(self, keep: frozenset[str] = frozenset()) -> None:
        parent = os.path.dirname(self.final)
        left = self.staged_siblings() - keep
        if not left:
            return  # (no lock file is made then)
        with contextlib.suppress(CheckpointError, OSError), run_lock(parent):
            for name in sorted(left):
                path = os.path.join(parent, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)

    def check_unlocked(self) -> None:
        check_unlocked(self.final)


class ObjectStoreDestination(Destination):
    """A prefix on an object store (``s3://...``): no rename and no lock there, so files go
    straight to the final prefix and the manifest, written last, is the commit; one writer per
    prefix is the caller's responsibility."""

    def check(self, *, overwrite: bool = False, sources: Sequence[str] = ()) -> None:
        from mfsdp_ckpt.storage.objstore import check_bucket

        check_bucket(self.final)  # else every upload fails, slowly, after retries
        exists = fs.exists(self.final)
        if exists and not overwrite:
            raise CheckpointExistsError(
                f"{self.final}: already exists (use --overwrite / overwrite=True to replace it)"
            )
        refuse_replacing_a_source(self.final, tuple(sources))
        check_apart(self.final, {"the source": tuple(sources)}, refuse=(INSIDE,))
        if exists and not fs.isfile(fs.join(self.final, MANIFEST_NAME)):
            raise CheckpointError(f"{self.final}: is not a committed checkpoint; refusing to replace it")

    def open(
        self, *, overwrite: bool = False, sources: Sequence[str] = (), clean_parent: bool = False, sync: bool = True
    ) -> str:
        from mfsdp_ckpt.storage.objstore import remove_uncommitted
        from mfsdp_ckpt.storage.remote import retrying

        self.check(overwrite=overwrite, sources=sources)
        if clean_parent:
            remove_uncommitted(fs.dirname(self.final))
        if fs.exists(self.final):  # un-commit first, so a failure in between never leaves a complete-looking mix
            retrying(self.final, "delete", self.uncommit)
        self.staging = self.final
        return self.final

    def commit(self, write_last: Callable[[], Any] | None = None) -> str:
        if write_last is not None:
            write_last()  # the manifest, written last, is the commit
        self.committed = True
        return self.final

    def clean(self) -> list[str]:
        from mfsdp_ckpt.errors import NotACheckpointError
        from mfsdp_ckpt.storage.objstore import remove_uncommitted

        if not fs.isdir(self.final):
            raise NotACheckpointError(f"{self.final}: no such directory")
        return remove_uncommitted(self.final)

    def probe(self) -> None:
        from mfsdp_ckpt.storage.objstore import check_writable_prefix

        check_writable_prefix(self.final)


class FileDestination(Destination):
    """One file (``convert --to torch|safetensors``), local or on an object store: written whole
    at commit (a rename of a partial sibling locally, one PUT on an object store), so there is no
    staging place and nothing to remove on failure."""

    def check(self, *, overwrite: bool = False, sources: Sequence[str] = ()) -> None:
        check_destination(self.final, overwrite=overwrite, kind="file", sources=tuple(sources))

    def open(
        self, *, overwrite: bool = False, sources: Sequence[str] = (), clean_parent: bool = False, sync: bool = True
    ) -> str:
        self.check(overwrite=overwrite, sources=sources)
        return self.final

    def commit(self, write_last: Callable[[], Any] | None = None) -> str:
        if write_last is not None:
            write_last()  # fs.write_bytes: all or nothing
        self.committed = True
        return self.final


def _remove_checkpoint(directory: str) -> None:
    """Remove a checkpoint, its manifest first (see :meth:`Destination.uncommit`)."""
    fs.remove_file(fs.join(directory, MANIFEST_NAME))
    fs.remove_tree(directory)


def _link_latest(parent: str, name: str) -> None:
    """Point the symlink ``latest-checkpoint`` at ``name``, atomically: a new link under a
    partial name renamed over the old one. A file system without symlinks gets a warning (the
    pointer file is already written, and it is what our readers follow)."""
    link = os.path.join(parent, LATEST_LINK_NAME)
    if os.path.lexists(link) and not os.path.islink(link):
        warnings.warn(
            f"{link}: not a symlink (a copy of the run?); left as it is; '{LATEST_NAME}' names the latest", stacklevel=3
        )
        return
    tmp = os.path.join(parent, f".{LATEST_LINK_NAME}{PARTIAL_MARK}{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, link)
        fsync_dir(parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        warnings.warn(
            f"{link}: cannot link the latest checkpoint ({e.strerror or e}); '{LATEST_NAME}' names it", stacklevel=3
        )
