"""A memory tier's data files: checking one against its recorded crc32c, and moving files between
nodes over the process group.

Nodes share no file system, so a node's files reach its peers as bytes sent by one rank (the
sending node's leader) and received by another (the receiving node's). Every rank walks the same
list of transfers in the same order and takes part only in its own, so the sends and receives
pair up without a deadlock whatever the list. A received file lands in ``<name>.partial``, is
checked against the crc32c the sender computed, and only then renamed: a file under its own name
is always whole.

Nothing is opened through a link (:mod:`mfsdp_ckpt.tier.entries`): a file is read only when it
is a regular file itself, a ``.partial`` is created new (``O_EXCL | O_NOFOLLOW``, whatever was
under its name unlinked first), and a file's size is checked before any byte of it is hashed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Iterator

import crc32c as _crc32c
import torch
import torch.distributed as dist

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.tier.entries import FILE, create_new, dir_problem, file_problem, kind_of, open_regular_nofollow
from mfsdp_ckpt.tier.layout import TierFile

__all__ = ["Transfer", "file_crc32c", "check_file", "move_files", "target_dirs"]

_KEPT_MAPPED: list[contextlib.ExitStack] = []  # the mappings of failed calls (see move_files)


def file_crc32c(path: str, size: int | None = None) -> tuple[int, int]:
    """``(size, crc32c)`` of the regular file at ``path`` (not through a link; read through a
    mapping: no copy of its bytes). With ``size``: a file of another size is not hashed at all
    (its crc32c is returned as -1), so a file grown to a terabyte costs one ``fstat``."""
    fd = open_regular_nofollow(path)
    with os.fdopen(fd, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if size is not None and actual != size:
            return actual, -1
        if actual == 0:
            return 0, _crc32c.crc32c(b"")
        with mmap.mmap(f.fileno(), actual, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return actual, _crc32c.crc32c(view)
            finally:
                view.release()


def check_file(directory: str, name: str, expected: TierFile, checksum: bool = True) -> str | None:
    """Why the copy of ``name`` in ``directory`` cannot be used (missing, a link or no regular
    file, another size, a crc32c mismatch), or None when it is whole (``checksum=False``: when it
    has the recorded size). The size is checked before any byte is read."""
    path = os.path.join(directory, name)
    problem = file_problem(path)
    if problem is not None:
        return problem
    try:
        if not checksum:
            size = os.lstat(path).st_size
            return None if size == expected.size else f"{size} bytes, not {expected.size}"
        size, crc = file_crc32c(path, expected.size)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if size != expected.size:
        return f"{size} bytes, not {expected.size}"
    if crc != expected.crc32c:
        return "crc32c mismatch"
    return None


@dataclass(frozen=True)
class Transfer:
    """Send file ``name`` from ``source``'s directory ``source_dir`` (on rank ``sender``) into
    ``target_dir`` (on rank ``receiver``)."""

    name: str
    sender: int
    receiver: int
    source_dir: str
    target_dir: str


def move_files(
    transfers: list[Transfer], expected: dict[str, TierFile], rank: int, group: dist.ProcessGroup | None = None
) -> None:
    """Carry out ``transfers`` (the same list on every rank, in the same order) over ``group`` (a
    group of every rank; None: the default one); this rank sends and receives its own, all at
    once (a node sends to its peers while it receives from them). The bytes go from the sender's
    file, mapped, into the receiver's ``<name>.partial``, mapped: no copy of them in memory on
    either side. A file that arrives damaged (another size or crc32c than ``expected``) is
    removed, and once every transfer is done the receiver raises :class:`CheckpointError` naming
    the first (going on to the end keeps every send paired with its receive); a whole one is
    renamed to its own name."""
    mine = [(tag, t) for tag, t in enumerate(transfers) if t.sender != t.receiver and rank in (t.sender, t.receiver)]
    sizes = _exchange_sizes(mine, rank, group)
    arrived: list[tuple[Transfer, str | None]] = []
    with contextlib.ExitStack() as mappings:
        try:
            _post_and_wait(mine, sizes, expected, rank, group, mappings, arrived)
        except BaseException:
            # a send or receive still in flight would write into unmapped memory (a tensor over a
            # mapping does not keep it mapped): a failed call keeps its mappings to the process's end
            _KEPT_MAPPED.append(mappings.pop_all())
            raise
    damaged = []
    for t, problem in arrived:
        path = os.path.join(t.target_dir, t.name)
        if problem is None:
            if kind_of(path + ".partial") != FILE:  # empty: nothing was mapped
                os.close(create_new(path + ".partial"))
            os.replace(path + ".partial", path)  # over a link under that name: the link goes, not its target
        else:
            damaged.append(problem)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + ".partial")
    if damaged:
        raise CheckpointError(damaged[0] + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""))


def _post_and_wait(
    mine: list[tuple[int, Transfer]],
    sizes: dict[int, int],
    expected: dict[str, TierFile],
    rank: int,
    group: dist.ProcessGroup | None,
    mappings: contextlib.ExitStack,
    arrived: list[tuple[Transfer, str | None]],
) -> None:
    """Post every send and receive of this rank at once (mappings entered on ``mappings``), wait
    for all, and add each received file's problem (None: whole) to ``arrived``."""
    sends: list[dist.Work] = []
    receives: list[tuple[Transfer, int, dist.Work | None, mmap.mmap | None]] = []
    for tag, t in mine:
        size = sizes[tag]
        travels = size == expected[t.name].size and size > 0  # else the receiver refuses it, or it is empty
        if rank == t.sender:
            if travels:
                mapped = mappings.enter_context(_mapping(os.path.join(t.source_dir, t.name), size))
                sends.append(_isend(mapped, t.receiver, group, tag))
            continue
        partial = os.path.join(t.target_dir, t.name) + ".partial"
        if travels:
            mapped = mappings.enter_context(_mapping(partial, size, create=True))
            receives.append((t, size, _irecv(mapped, t.sender, group, tag), mapped))
        else:
            receives.append((t, size, None, None))
    for work in sends:
        work.wait()
    for t, size, work, mapped in receives:
        if work is not None:
            work.wait()
        arrived.append((t, _arrival_problem(t, size, mapped, expected[t.name])))


def _exchange_sizes(mine: list[tuple[int, Transfer]], rank: int, group: dist.ProcessGroup | None) -> dict[int, int]:
    """Each transfer's size as its sender finds its file (-1: missing or unreadable), known to both ends."""
    sizes: dict[int, torch.Tensor] = {}
    works = []
    for tag, t in mine:
        if rank == t.sender:
            path = os.path.join(t.source_dir, t.name)
            size = os.lstat(path).st_size if kind_of(path) == FILE else -1  # a link is not sent
            sizes[tag] = torch.tensor([size], dtype=torch.int64)
            works.append(dist.isend(sizes[tag], dst=t.receiver, group=group, tag=tag))
        else:
            sizes[tag] = torch.zeros(1, dtype=torch.int64)
            works.append(dist.irecv(sizes[tag], src=t.sender, group=group, tag=tag))
    for work in works:
        work.wait()
    return {tag: int(size.item()) for tag, size in sizes.items()}


def target_dirs(transfers: list[Transfer], rank: int) -> None:
    """Check the directories this rank receives into (before any transfer is posted, so that a
    refusal leaves no send without its receive): each must be a real directory of the tier (a
    link is never written through); :class:`CheckpointError` naming the first that is not."""
    for t in transfers:
        if t.receiver == rank and t.sender != rank:
            problem = dir_problem(t.target_dir)
            if problem is None and not os.path.isdir(t.target_dir):
                problem = f"{t.target_dir}: missing"
            if problem is not None:
                raise CheckpointError(problem)


@contextlib.contextmanager
def _mapping(path: str, size: int, create: bool = False) -> Iterator[mmap.mmap]:
    """``size`` bytes of the file at ``path`` mapped: to send (a private mapping: nothing written
    back; the file itself, not a link), or, with ``create``, a new file of that size to receive
    into (created new: never written through a link left under its name)."""
    fd = create_new(path) if create else open_regular_nofollow(path)
    with os.fdopen(fd, "w+b" if create else "rb") as f:
        if create:
            f.truncate(size)
        access = mmap.ACCESS_WRITE if create else mmap.ACCESS_COPY
        with mmap.mmap(f.fileno(), size, access=access) as mapped:
            yield mapped


def _isend(mapped: mmap.mmap, dst: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    work = dist.isend(torch.frombuffer(mapped, dtype=torch.uint8), dst=dst, group=group, tag=tag)
    assert work is not None
    return work


def _irecv(mapped: mmap.mmap, src: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    work = dist.irecv(torch.frombuffer(mapped, dtype=torch.uint8), src=src, group=group, tag=tag)
    assert work is not None
    return work


def _arrival_problem(t: Transfer, size: int, mapped: mmap.mmap | None, expected: TierFile) -> str | None:
    """Why a received file cannot be kept (None: it is whole)."""
    if size != expected.size:
        got = "missing at the sender" if size < 0 else f"{size} bytes"
        return f"{t.name} from rank {t.sender}: arrived damaged ({got}; recorded {expected.size} bytes)"
    if mapped is None:
        crc = _crc32c.crc32c(b"")
    else:
        view = memoryview(mapped)
        try:
            crc = _crc32c.crc32c(view)
        finally:
            view.release()
    if crc != expected.crc32c:
        return (
            f"{t.name} from rank {t.sender}: arrived damaged (crc32c {crc:08x}; "
            f"recorded {expected.size} bytes, {expected.crc32c:08x})"
        )
    return None
