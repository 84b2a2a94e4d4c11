"""One writer per run directory: a lock file that names its holder.

Two jobs writing checkpoints into one directory interleave their step directories and move
``latest`` back and forth between them. The lock makes the second one fail at once instead.

The lock is ``<run>/.mfsdp.lock``, held with ``flock`` for as long as the writer runs: the kernel
releases it when the holder exits however it exits, so a lock left by a killed job is never in the
way (no stale-lock guessing from pids, which hosts and pid reuse make unreliable). The file holds
JSON naming the holder (host, pid, and when it took the lock) so that the error a second job gets
says who is writing. Within one process the lock is re-entrant: the trainer holds it for the
whole run, and each save inside takes it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any, Iterator

from mfsdp_ckpt.errors import CheckpointError, RunLockedError
from mfsdp_ckpt.format.names import LOCK_NAME

__all__ = ["run_lock", "lock_holder", "check_unlocked"]


_held: dict[str, tuple[int, int]] = {}  # run directory -> (lock file descriptor, times held by this process)


def lock_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What the lock file of ``run_dir`` says about its last holder (None: no lock file)."""
    try:
        with open(os.path.join(os.fspath(run_dir), LOCK_NAME), "rb") as f:
            data = json.loads(f.read(4096) or b"{}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder unknown"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {holder.get('host')!r}, pid {holder.get('pid')}, since {when}"


def _acquire(run_dir: str) -> int:
    """Open and ``flock`` the lock file; the descriptor stays open while the lock is held."""
    path = os.path.join(run_dir, LOCK_NAME)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"{run_dir}: cannot write there ({e.strerror}; the writer lock {LOCK_NAME} "
                "is created in the destination's directory)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(
                f"{run_dir}: another job is writing checkpoints here ({_describe(lock_holder(run_dir))})"
            ) from None
        except OSError as e:
            os.close(fd)
            raise CheckpointError(f"{path}: cannot lock ({e.strerror})") from None
        try:  # the file we locked must still be the one at ``path`` (a releaser may have removed it)
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _blocker(path: str) -> str | None:
    """``<ancestor> is a file, not a directory`` when an existing ancestor of ``path`` is not a
    directory (the usual reason a destination cannot be created), else None."""
    probe = path
    while probe and not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    if probe and os.path.lexists(probe) and not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    return None


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the writer lock of ``run_dir`` (created if missing) inside ``with``; re-entrant within
    a process. Raises :class:`RunLockedError` when another process holds it."""
    run_dir = os.path.abspath(os.fspath(run_dir))
    if run_dir not in _held:
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"{run_dir}: cannot create the directory ({_blocker(run_dir) or e.strerror})"
            ) from None
        _held[run_dir] = (_acquire(run_dir), 0)
    fd, count = _held[run_dir]
    _held[run_dir] = (fd, count + 1)
    try:
        yield
    finally:
        fd, count = _held[run_dir]
        if count > 1:
            _held[run_dir] = (fd, count - 1)
        else:
            del _held[run_dir]
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, LOCK_NAME))  # while still locked: nobody holds a removed file
            os.close(fd)


def check_unlocked(run_dir: str | os.PathLike) -> None:
    """Raise :class:`RunLockedError` when another process holds the lock of ``run_dir``; creates
    nothing (no directory, no lock file), so a run can refuse early and leave no trace. A lock this
    process holds, or no lock file at all, passes. Only a hint before :func:`run_lock`: the lock may
    be taken between the two, and ``run_lock`` then refuses as ever."""
    run_dir = os.path.abspath(os.fspath(run_dir))
    if run_dir in _held:
        return
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none we may open): nobody to be refused for; run_lock decides
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunLockedError(
            f"{run_dir}: another job is writing checkpoints here ({_describe(lock_holder(run_dir))})"
        ) from None
    except OSError:
        return
    finally:
        os.close(fd)  # closing releases a shared lock taken here
