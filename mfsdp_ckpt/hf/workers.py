"""A few threads working through a list of tasks, for the HF bridge's parallel export and import.

Threads are enough: what a task spends its time on (reading chunks, crc32c, tensor copies and
casts, ``pwritev`` / ``preadv``, ``fsync``) runs in C with the GIL released. Each thread keeps
its own state (an open reader, a staging buffer reused for every task, so that its pages are
faulted in once) and takes the next task in list order. Progress is reported from the calling
thread (a progress bar need not be thread-safe). The first failure stops the others after their
current task and is raised in the caller, as it was raised in the worker (so a one-line
:class:`~mfsdp_ckpt.errors.CheckpointError` stays one line).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.files import parse_size
from mfsdp_ckpt.write.threads import start_all

__all__ = [
    "Cancelled",
    "DEFAULT_MAX_FILE_SIZE",
    "Staging",
    "Turns",
    "check_workers",
    "default_workers",
    "max_file_bytes",
    "run_tasks",
]

T = TypeVar("T")
S = TypeVar("S")

#: the default number of worker threads: ``min(4, CPUs)``
MAX_DEFAULT_WORKERS = 4


def default_workers() -> int:
    """``min(4, os.cpu_count())``: more threads than cores only compete, and four already keep a
    fast disk busy."""
    return max(1, min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1))


def check_workers(workers: int | None) -> int:
    """``workers``, or the default for None; a one-line ConversionError for anything but a
    positive integer."""
    from mfsdp_ckpt.errors import ConversionError

    if workers is None:
        return default_workers()
    if type(workers) is not int or workers < 1:
        raise ConversionError(f"workers must be a positive integer, got {workers!r}")
    return workers


#: the size of a checkpoint's data files past which ``import-hf``, ``export-mcore`` and ``convert``
#: start a new one (so that the processes of a job can share whole files out)
DEFAULT_MAX_FILE_SIZE = "5GB"


def max_file_bytes(value: str | int) -> int:
    """``max_file_size`` (``--max-file-size``: ``"5GB"``, ``"500MiB"``, bytes) in bytes; refused
    in one line naming the option."""
    try:
        return parse_size(value)
    except ConversionError as e:
        raise ConversionError(f"--max-file-size: {str(e).replace('max shard size ', '')}") from None


class Staging:
    """One reusable byte buffer, grown to the largest request: a worker reads every tensor into
    it instead of allocating (and page-faulting) a fresh one each time. Peak memory: the largest
    tensor asked for."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` over the buffer (its old bytes: to be
        overwritten). Valid until the next call."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(0, dtype=torch.uint8)  # free the old one before the new one
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype).view(tuple(shape))


class Cancelled(Exception):
    """A worker stopped because another one failed (never the error reported)."""


class Turns:
    """Sections that workers enter in task order: ``with turns.of(i):`` waits until the sections
    of tasks ``0 .. i-1`` are done. Work before the section runs in parallel; what must come out
    in order (appending to one file) goes inside. :meth:`cancel` wakes every waiting worker with
    :class:`Cancelled` (the pool calls it when a worker fails, so no one waits for a turn that
    never comes)."""

    def __init__(self) -> None:
        self._next = 0
        self._cancelled = False
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def of(self, i: int) -> Iterator[None]:
        with self._cond:
            while self._next != i and not self._cancelled:
                self._cond.wait()
            if self._cancelled:
                raise Cancelled()
        yield  # an exception here leaves the turn taken: the pool cancels the others
        with self._cond:
            self._next += 1
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


def run_tasks(
    tasks: Sequence[T],
    workers: int,
    make_state: Callable[[], S],
    do: Callable[[S, T], int],
    close_state: Callable[[S], None] = lambda s: None,
    progress: Callable[[int], None] | None = None,
    turns: Turns | None = None,
) -> None:
    """Run ``do(state, task)`` for every task on ``workers`` threads (``workers == 1``: on the
    calling thread), each thread with its own ``make_state()`` (closed with ``close_state``).
    ``do`` returns a number of bytes, passed to ``progress`` from the calling thread. Raises the
    first failure once every thread has stopped (``turns``, if the tasks use one, is cancelled
    then)."""
    if workers <= 1 or len(tasks) <= 1:
        state = make_state()
        try:
            for task in tasks:
                n = do(state, task)
                if progress is not None:
                    progress(n)
        finally:
            close_state(state)
        return
    _Pool(tasks, min(workers, len(tasks)), make_state, do, close_state, turns).run(progress)


class _Pool(Generic[T, S]):
    def __init__(
        self,
        tasks: Sequence[T],
        workers: int,
        make_state: Callable[[], S],
        do: Callable[[S, T], int],
        close_state: Callable[[S], None],
        turns: Turns | None,
    ) -> None:
        self.tasks, self.make_state, self.do, self.close_state, self.turns = tasks, make_state, do, close_state, turns
        self.next = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.threads = [threading.Thread(target=self._work, name=f"hf-worker-{i}", daemon=True) for i in range(workers)]

    def _take(self) -> T | None:
        with self.lock:
            if self.stop.is_set() or self.next >= len(self.tasks):
                return None
            self.next += 1
            return self.tasks[self.next - 1]

    def _work(self) -> None:
        state: Any = None
        try:
            state = self.make_state()
            while (task := self._take()) is not None:
                self.events.put(("done", self.do(state, task)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            self.stop.set()
            self.events.put(("error", e))
        finally:
            try:
                if state is not None:
                    self.close_state(state)
            except BaseException as e:  # noqa: BLE001 - as above
                self.events.put(("error", e))
            finally:
                self.events.put(("exit", None))

    def _halt(self) -> None:
        self.stop.set()
        if self.turns is not None:
            self.turns.cancel()

    def run(self, progress: Callable[[int], None] | None) -> None:
        running, failure = len(self.threads), None
        try:  # the starts too: a Ctrl-C while the first workers already write must stop and join them
            start_all(self.threads)
            while running:
                kind, value = self.events.get()
                if kind == "exit":
                    running -= 1
                elif kind == "error":
                    self._halt()
                    if failure is None or isinstance(failure, Cancelled):
                        failure = value
                elif progress is not None and failure is None:
                    progress(value)
        except BaseException as e:  # noqa: BLE001 - the progress callback failed (or ^C): stop the workers, then raise it
            self._halt()
            failure = failure or e
        # a worker that said "exit" still drops its state (tensors, open files) on the way out: a
        # daemon thread doing that while the interpreter finalizes is killed inside C++ code,
        # and the process aborts ("terminate called without an active exception") after its error
        for t in self.threads:
            if t.ident is not None:  # started (start_all's own failure may come before the last start)
                t.join()
        if failure is not None:
            raise failure
