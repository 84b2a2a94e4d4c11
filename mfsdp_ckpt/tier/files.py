"""A memory tier's data files: checking one against its recorded crc32c, and moving files between
nodes over the process group.

Nodes share no file system, so a node's files reach its peers as bytes sent by one rank (the
sending node's leader) and received by another (the receiving node's). Every rank walks the same
list of transfers in the same order and takes part only in its own, so the sends and receives
pair up without a deadlock whatever the list. A received file is checked against the crc32c the
sender computed before it is written, and written as ``<name>.partial`` then renamed: a file under
its own name is always whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import crc32c as _crc32c
import torch
import torch.distributed as dist

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.tier.layout import TierFile

__all__ = ["Transfer", "file_crc32c", "check_file", "move_files"]

_PIECE = 8 << 20  # bytes read at a time to checksum a file


def file_crc32c(path: str) -> tuple[int, int]:
    """``(size, crc32c)`` of the file at ``path``."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(_PIECE):
            crc = _crc32c.crc32c(piece, crc)
            size += len(piece)
    return size, crc


def check_file(directory: str, name: str, expected: TierFile, checksum: bool = True) -> str | None:
    """Why the copy of ``name`` in ``directory`` cannot be used (missing, another size, a crc32c
    mismatch), or None when it is whole (``checksum=False``: when it has the recorded size)."""
    path = os.path.join(directory, name)
    if os.path.islink(path) or not os.path.isfile(path):
        return "missing"
    try:
        if not checksum:
            size = os.path.getsize(path)
            return None if size == expected.size else f"{size} bytes, not {expected.size}"
        size, crc = file_crc32c(path)
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
    group of every rank; None: the default one); this rank sends and receives its own. A file that arrives damaged (another size or crc32c than ``expected``)
    is not written, and once every transfer is done the receiver raises :class:`CheckpointError`
    naming the first (going on to the end keeps every later send paired with its receive)."""
    damaged: list[str] = []
    for t in transfers:
        if t.sender == t.receiver:
            continue
        if rank == t.sender:
            with open(os.path.join(t.source_dir, t.name), "rb") as f:
                data = bytearray(f.read())
            dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=t.receiver, group=group)
            if data:
                dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=t.receiver, group=group)
        elif rank == t.receiver:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src=t.sender, group=group)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                dist.recv(buf, src=t.sender, group=group)
            problem = _write_checked(t, buf.numpy().tobytes(), expected[t.name])
            if problem is not None:
                damaged.append(problem)
    if damaged:
        raise CheckpointError(damaged[0] + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""))


def _write_checked(t: Transfer, data: bytes, expected: TierFile) -> str | None:
    """Write a received file if it is whole; else why not."""
    if len(data) != expected.size or crc32c(data) != expected.crc32c:
        return (
            f"{t.name} from rank {t.sender}: arrived damaged ({len(data)} bytes, crc32c {crc32c(data):08x}; "
            f"recorded {expected.size} bytes, {expected.crc32c:08x})"
        )
    os.makedirs(t.target_dir, exist_ok=True)
    path = os.path.join(t.target_dir, t.name)
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)
    return None
