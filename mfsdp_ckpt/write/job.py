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
nothing for those). A process that dies (SIGKILL) never reaches the gather: nothing is committed,
and the collective the others wait in fails (:class:`JobLostError`). A shared file system is
assumed across machines: every process writes into the same staging directory.

Outside a process group (or in a group of one) every step is a plain call: the tools behave as
they did before they were collective.
"""

from __future__ import annotations

import datetime
import heapq
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.write.builder import CheckpointBuilder, ChunkRecord

__all__ = [
    "JOB_TIMEOUT",
    "Job",
    "JobFailedElsewhere",
    "JobLostError",
    "split_by_size",
    "write_checkpoint",
    "write_and_commit",
    "record_order",
]

T = TypeVar("T")
R = TypeVar("R")

#: how long a collective of an offline job waits (the gather waits for the slowest process's
#: share of a whole checkpoint, so far longer than the 30 minutes a training step may take)
JOB_TIMEOUT = datetime.timedelta(hours=12)


class JobFailedElsewhere(CheckpointError):
    """Raised on the processes of a job that did not fail when another did (``rank``): that one
    raises its own error, and the job reports the failure once, in its words."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class JobLostError(CheckpointError):
    """A collective of the job failed: another process died (killed, out of memory) or the
    connection to it broke. Nothing was committed."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _outcome(failure: BaseException | None) -> tuple[str, str] | None:
    """What a process tells the others of its failure: plain strings (an exception object may
    not pickle)."""
    return None if failure is None else (type(failure).__name__, _one_line(failure))


@dataclass(frozen=True)
class Job:
    """This process's place in the job: ``rank`` of ``world`` processes (``(0, 1)``: alone)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Job":
        """The job of the default process group, or a job of one outside any."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        """Whether this is process 0: the one that commits and reports."""
        return self.rank == 0

    def owners(self, sizes: Sequence[int]) -> list[int]:
        """The process that writes each output file, from the files' sizes alone (the same on
        every process): largest first, each onto the least-loaded process (ties: the lower
        file, the lower rank), so every process gets about the same bytes."""
        loads = [(0, p) for p in range(self.world)]  # a heap of (bytes so far, rank)
        owner = [0] * len(sizes)
        for f in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            load, p = heapq.heappop(loads)
            owner[f] = p
            heapq.heappush(loads, (load + sizes[f], p))
        return owner

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """The output files (indices into ``sizes``) this process writes, in order."""
        return [f for f, p in enumerate(self.owners(sizes)) if p == self.rank]

    def _collective(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a collective); a backend failure (a dead peer, a timeout) becomes
        :class:`JobLostError`."""
        try:
            return fn()
        except (RuntimeError, ConnectionError) as e:
            raise JobLostError(
                f"process {self.rank} of {self.world}: another process of the job stopped (it failed or was "
                f"killed; torchrun's report names it): {_one_line(e)[:200]}"
            ) from None

    def gather_to_main(self, value: Any) -> list[Any] | None:
        """``value`` of every process, in rank order, on process 0 (None elsewhere)."""
        if self.world == 1:
            return [value]
        out: list[Any] | None = [None] * self.world if self.main else None
        self._collective(lambda: dist.gather_object(value, out, dst=0))
        return out

    def broadcast(self, value: Any) -> Any:
        """Process 0's ``value`` on every process."""
        if self.world == 1:
            return value
        box = [value if self.main else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def raise_outcome(self, failure: BaseException | None, failed: tuple[int, str, str] | None, what: str) -> None:
        """Raise the agreed failure ``failed`` (``(rank, kind, message)``; None: none): the
        process that hit it raises ``failure``, its own; the others :class:`JobFailedElsewhere`."""
        if failed is None:
            return
        rank, kind, message = failed
        if rank == self.rank and failure is not None:
            raise failure
        raise JobFailedElsewhere(f"{what}: rank {rank} failed ({kind}: {message})", rank)

    def agree(self, failure: BaseException | None, what: str) -> None:
        """Collective: every process says whether it failed; if any did, every process raises
        (:meth:`raise_outcome`, the lowest failing rank's error)."""
        if self.world == 1:
            if failure is not None:
                raise failure
            return
        outcomes = self.gather_to_main(_outcome(failure))
        first = None
        if outcomes is not None:
            first = next(((r, *o) for r, o in enumerate(outcomes) if o is not None), None)
        self.raise_outcome(failure, self.broadcast(first), what)

    def run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on every process, then :meth:`agree` on its failure (a refusal that every
        process reaches is then reported once, by process 0)."""
        failure: Exception | None = None
        value: Any = None
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - agreed on, then raised on every process
            failure = e
        self.agree(failure, what)
        return value

    def on_main(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on process 0; its result (which must pickle) on every process, or its
        failure: process 0 raises its own, the others :class:`JobFailedElsewhere`."""
        if self.world == 1:
            return fn(*args)
        failure: Exception | None = None
        value: Any = None
        if self.main:
            try:
                value = fn(*args)
            except Exception as e:  # noqa: BLE001 - raised below, on every process
                failure = e
        ok, value = self.broadcast((failure is None, value if failure is None else (0, *_outcome(failure))))
        if not ok:
            self.raise_outcome(failure, value, what)
        return value


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
    open_: Callable[[], str],
    write: Callable[[str], R],
    conclude: Callable[[list[R]], T],
    abort: Callable[[], None],
) -> T:
    """The job's write and its one commit (the steps of the module docstring). ``open_()``
    (process 0) makes the staging place and returns it; ``write(staging)`` (every process)
    writes this process's files and returns what process 0 needs of them (it must pickle);
    ``conclude(parts)`` (process 0, every part in rank order) commits and returns the result
    for every process; ``abort()`` (process 0) removes what was written, on any failure."""
    staging = job.on_main(what, open_)
    committed = False
    try:
        part, failure = None, None
        try:
            part = write(staging)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every process
            failure = e
        parts = job.gather_to_main((_outcome(failure), part))
        verdict: tuple[Any, ...] = ()
        commit_error: Exception | None = None
        if job.main:
            verdict, commit_error = _conclude(parts, conclude)
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


def _conclude(parts: list[Any] | None, conclude: Callable[[list[Any]], T]) -> tuple[tuple[Any, ...], Exception | None]:
    """Process 0's verdict over every process's ``(outcome, part)`` (plain data, for the others):
    ``("failed", (rank, kind, message))`` for the lowest failing rank, ``("ok", result)`` once
    committed, or ``("error", (kind, message))`` when committing failed, with that exception."""
    assert parts is not None
    first = next(((r, *o) for r, (o, _) in enumerate(parts) if o is not None), None)
    if first is not None:
        return ("failed", first), None
    try:
        return ("ok", conclude([p for _, p in parts])), None
    except Exception as e:  # noqa: BLE001 - raised by process 0, named to the others
        return ("error", _outcome(e)), e


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
