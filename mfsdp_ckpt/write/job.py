"""The offline tools (``reshard``, ``export-hf``, ``import-hf``, ``export-mcore``, ``convert``) as
one job of several processes: who writes which output file, and the one commit.

A tool is collective when ``torch.distributed`` is initialised (``mfsdp-ckpt`` does that under
``torchrun``: a gloo group, CPU only). Every process plans the whole output from the source's
metadata alone, so the plans agree without a word exchanged; the output's data files are shared
out by :meth:`Job.owners` (a function of their sizes, the same on every process), and each
process reads only the source byte ranges its own files need. Then, in a fixed order of
collectives that no failure changes:

1. process 0 opens the destination (the parent's writer lock, the refusals, a staging directory;
   on an object store the prefix itself) and tells the others where to write
   (:meth:`Job.on_main`);
2. every process writes its files into it;
3. one gather to process 0 of what each wrote (records or its failure); process 0 commits (the
   manifest and index files, then the rename, or on an object store the manifest last) or, if
   any process failed, removes the staging directory; one broadcast of the outcome.

A failure is raised on every process, but only the process that hit it raises its own error; the
others raise :class:`JobFailedElsewhere`, so a job reports it once (the command line prints
nothing for those). The live ``save`` runs the same protocol with the other rule
(``same_error=True``): every rank raises the same :class:`~mfsdp_ckpt.errors.CheckpointError`,
the first failing rank's, so that a trainer on any rank reports the same line. A process that dies (SIGKILL) never reaches the gather: nothing is committed,
and the collective the others wait in fails (:class:`JobLostError`). A shared file system is
assumed across machines: every process writes into the same staging directory.

Outside a process group (or in a group of one) every step is a plain call: the tools behave as
they did before they were collective.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence, TypeVar

from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import CheckpointBuilder, ChunkRecord

__all__ = [
    "split_by_size",
    "write_checkpoint",
    "write_and_commit",
    "record_order",
]

T = TypeVar("T")
R = TypeVar("R")


def split_by_size(sizes: Sequence[int], max_bytes: int) -> list[int]:
    """The data file of each item, written in order: a new file starts where the next item would
    take the current one past ``max_bytes`` (an item larger than that gets a file of its own).
    A function of the sizes only, never of the number of processes."""
    out, file, size = [], 0, 0
    for n in sizes:
        if size and size + n > max_bytes:
            file, size = file + 1, 0
        out.append(file)
        size += n
    return out


_NUMBERS = re.compile(r"\d+")


def record_order(record: ChunkRecord) -> tuple[Any, ...]:
    """Where a chunk lies: its data file (``__<a>_<b>.distcp`` by the numbers in its name), then
    its offset. Records are listed in this order whatever process or thread wrote them, so
    ``.metadata`` and the manifest do not depend on the number of either."""
    return (tuple(int(n) for n in _NUMBERS.findall(record.file)), record.file, record.offset)


def write_and_commit(
    job: Job,
    what: str,
    open_: Callable[[], str] | str,
    write: Callable[[str], R],
    conclude: Callable[[list[R]], T],
    abort: Callable[[], None],
) -> T:
    """The job's write and its one commit (the steps of the module docstring). ``open_()``
    (process 0) makes the staging place and returns it (a path: a place every process already
    knows, with no collective to tell them); ``write(staging)`` (every process)
    writes this process's files and returns what process 0 needs of them (it must pickle);
    ``conclude(parts)`` (process 0, every part in rank order) commits and returns the result
    for every process; ``abort()`` (process 0) removes what was written, on any failure."""
    staging = open_ if isinstance(open_, str) else job.on_main(what, open_)
    committed = False
    try:
        part, failure = None, None
        try:
            part = write(staging)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every process
            failure = e
        parts = job.gather_to_main((job.outcome(failure), part))
        verdict: tuple[Any, ...] = ()
        commit_error: Exception | None = None
        if job.main:
            verdict, commit_error = _conclude(job, parts, conclude)
            committed = verdict[0] == "ok"
        verdict = job.broadcast(verdict)
        if verdict[0] == "failed":
            job.raise_outcome(failure, verdict[1], what)
        if verdict[0] == "error":  # process 0 failed to commit
            job.raise_outcome(commit_error, (0, *verdict[1]), what)
        return verdict[1]
    finally:
        if job.main and not committed:
            abort()


def _conclude(
    job: Job, parts: list[Any] | None, conclude: Callable[[list[Any]], T]
) -> tuple[tuple[Any, ...], Exception | None]:
    """Process 0's verdict over every process's ``(outcome, part)`` (what pickles, for the
    others): ``("failed", (rank, kind, message, error))`` for the lowest failing rank,
    ``("ok", result)`` once committed, or ``("error", (kind, message, error))`` when committing
    failed, with that exception (see :meth:`Job.outcome`)."""
    assert parts is not None
    first = next(((r, *o) for r, (o, _) in enumerate(parts) if o is not None), None)
    if first is not None:
        return ("failed", first), None
    try:
        return ("ok", conclude([p for _, p in parts])), None
    except Exception as e:  # noqa: BLE001 - raised by process 0, named to the others
        return ("error", job.outcome(e)), e


def write_checkpoint(
    job: Job,
    dst: str,
    manifest: dict[str, Any],
    write: Callable[[str], tuple[list[ChunkRecord], Any]],
    *,
    overwrite: bool = False,
    sources: Sequence[str] = (),
    finish: Callable[[CheckpointBuilder, list[Any]], Any] | None = None,
) -> tuple[str, int, Any]:
    """A canonical checkpoint written by the whole job: process 0 opens a
    :class:`~mfsdp_ckpt.write.builder.CheckpointBuilder` at ``dst``; every process's
    ``write(staging)`` writes its own data files there (with a
    :class:`~mfsdp_ckpt.write.builder.ChunkFileWriter`) and returns their records and anything
    else process 0 needs (``info``, picklable); process 0 lists every record
    (:func:`record_order`), calls ``finish(builder, infos)`` (checks over the whole job, files
    besides the data files) and commits. Returns, on every process, the path, the bytes of data
    written and what ``finish`` returned."""
    holder: list[CheckpointBuilder] = []

    def open_() -> str:
        holder.append(CheckpointBuilder(dst, manifest, overwrite=overwrite, sources=sources))
        return holder[0].tmp

    def conclude(parts: list[tuple[list[ChunkRecord], Any]]) -> tuple[str, int, Any]:
        builder = holder[0]
        builder.add_records(sorted((r for records, _ in parts for r in records), key=record_order))
        extra = finish(builder, [info for _, info in parts]) if finish is not None else None
        path = builder.commit()
        return path, builder.bytes_written, extra

    def abort() -> None:
        if holder:
            holder[0].abort()

    return write_and_commit(job, f"{dst}: not written", open_, write, conclude, abort)
