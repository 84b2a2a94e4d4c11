"""What the memory tier may touch: its own directories and files, never through a link.

A tier lives on a shared tmpfs (``/dev/shm``) where anyone may plant an entry. Below a run's
directory (``<tier>/<run id>``, which the run creates) every entry the tier reads, writes, renames
or removes is looked at with ``lstat`` first: a symbolic link, a FIFO or a device where the tier
expects one of its directories or files is never followed. Readers ignore it (and say so in one
line); writers refuse to write through it (one line naming it); removals remove only real
directories of the tier (``shutil.rmtree`` then never follows a link inside them). New files are
created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` after whatever was left under the name is unlinked
(a link is removed as a link: its target is untouched). Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from mfsdp_ckpt.errors import CheckpointError

__all__ = [
    "DIRECTORY",
    "FILE",
    "LINK",
    "OTHER",
    "kind_of",
    "dir_problem",
    "file_problem",
    "ensure_dir",
    "create_new",
    "write_new",
    "open_regular_nofollow",
    "remove_dir",
]

DIRECTORY, FILE, LINK, OTHER = "directory", "regular file", "symbolic link", "FIFO, socket or device"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def kind_of(path: str) -> str | None:
    """What is at ``path`` itself (a link is a link, not what it points to); None: nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError:
        return OTHER
    if stat.S_ISLNK(mode):
        return LINK
    if stat.S_ISDIR(mode):
        return DIRECTORY
    if stat.S_ISREG(mode):
        return FILE
    return OTHER


def dir_problem(path: str) -> str | None:
    """Why ``path`` is no directory of the tier (None: it is a real directory, or absent)."""
    kind = kind_of(path)
    if kind in (None, DIRECTORY):
        return None
    return f"{path}: a {kind}, not a directory of the memory tier (nothing is read or written through it)"


def file_problem(path: str) -> str | None:
    """Why ``path`` is no file of the tier: absent, a link or not a regular file (None: it is one)."""
    kind = kind_of(path)
    if kind == FILE:
        return None
    return "missing" if kind is None else f"a {kind}, not used"


def ensure_dir(path: str, top: str) -> None:
    """Make ``path`` and the directories between it and ``top`` (which it lies under; ``top``
    itself the tier's root, the user's to choose) real directories, creating what is missing;
    :class:`CheckpointError` naming the first entry on the way that is not a directory."""
    top = os.path.abspath(top)
    path = os.path.abspath(path)
    rel = os.path.relpath(path, top)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise CheckpointError(f"{path}: outside the memory tier {top}")
    os.makedirs(top, exist_ok=True)
    current = top
    for part in [] if rel == os.curdir else rel.split(os.sep):
        current = os.path.join(current, part)
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        problem = dir_problem(current)
        if problem is not None:
            raise CheckpointError(problem)


def create_new(path: str) -> int:
    """A new, empty file at ``path`` opened for reading and writing (a descriptor): whatever was
    left under the name (a file of an earlier try, a link) is unlinked first, never followed, and
    the file is created with ``O_EXCL | O_NOFOLLOW``, so a link planted meanwhile fails the call
    instead of being written through. A directory there is an ``OSError``."""
    if kind_of(path) in (FILE, LINK, OTHER):
        os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)


def write_new(path: str, data: bytes) -> None:
    """``data`` as the new file ``path`` (:func:`create_new`)."""
    fd = create_new(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def open_regular_nofollow(path: str) -> int:
    """``path`` opened read-only if it is a regular file itself (not through a link: ``ELOOP``;
    a FIFO or device: ``EINVAL``, checked before any read, so nothing blocks); a descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_dir(path: str) -> bool:
    """Remove the tier's directory ``path`` with everything in it, if it is a real directory
    (links inside it are removed as links); a link or anything else there is left as it is.
    Whether something was removed."""
    if kind_of(path) != DIRECTORY:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
