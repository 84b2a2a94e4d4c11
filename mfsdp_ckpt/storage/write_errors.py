"""Failed writes as one clear line: "No space left on device while writing <file>".

``torch.save`` into a Python stream swallows the stream's ``OSError`` and raises
``RuntimeError: ... unexpected pos ...`` instead, so a full disk surfaces as an internal error of
torch's zip writer. Every writer here writes through :class:`RecordingStream`, which remembers the
first ``OSError`` of its file, and reports failures with :func:`write_failed`, which names the
file and the operating system's reason.

The same writer turns a Ctrl-C that lands inside it (``KeyboardInterrupt`` raised in the stream's
``write`` callback) into ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected
pos``: its end-of-archive check fails while the interrupt unwinds. :func:`reporting` raises the
interrupt instead (:func:`interrupt_behind` finds it), so that an interrupted write is an
interrupt, wherever it landed.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Iterator, Sequence

from mfsdp_ckpt.errors import CheckpointError, WriteFailedError

__all__ = ["RecordingStream", "write_failed", "reporting", "interrupt_behind"]


def write_failed(error: OSError, path: str | os.PathLike) -> WriteFailedError:
    """The one-line error for ``error`` raised while writing ``path``."""
    reason = error.strerror or str(error) or type(error).__name__
    return WriteFailedError(f"{reason} while writing {os.fspath(path)}")


def interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` that ``error`` is, or was raised while handling (its
    ``__context__`` / ``__cause__`` chain); None when no interrupt is behind it."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class RecordingStream:
    """A binary file object that remembers the first ``OSError`` its ``write`` / ``flush`` /
    ``close`` raised (and raises it as usual); everything else is the wrapped file's.
    ``max_write``: the most bytes handed to the wrapped file per ``write`` call (None: no bound;
    an asynchronous save bounds its writes so that each call returns its core soon)."""

    def __init__(self, f: IO[bytes], path: str | os.PathLike, max_write: int | None = None) -> None:
        self._f = f
        self.path = os.fspath(path)
        self.error: OSError | None = None
        self.max_write = max_write

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def write(self, data: Any) -> int:
        if self.max_write is None:
            return self._guard(self._f.write, data)
        view = memoryview(data).cast("B")
        for lo in range(0, view.nbytes, self.max_write):
            self._guard(self._f.write, view[lo : lo + self.max_write])
        return view.nbytes

    def flush(self) -> None:
        self._guard(self._f.flush)

    def close(self) -> None:
        self._guard(self._f.close)

    def __enter__(self) -> "RecordingStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def reporting(path: str | os.PathLike, streams: Sequence[RecordingStream] = ()) -> Iterator[None]:
    """Inside ``with``, an ``OSError`` (raised directly, or recorded by one of ``streams`` and
    hidden behind another exception, e.g. torch's zip writer's) becomes one
    :class:`WriteFailedError` naming the file; an error hiding a ``KeyboardInterrupt`` (Ctrl-C
    inside ``torch.save``) is that interrupt. ``streams`` is read when the error happens, so a
    list that grows inside ``with`` is seen whole."""
    try:
        yield
    except CheckpointError:
        raise
    except BaseException as e:
        interrupt = interrupt_behind(e)
        if interrupt is not None and interrupt is not e:
            raise interrupt from None
        recorded = next((s for s in streams if s.error is not None), None)
        if recorded is not None:
            raise write_failed(recorded.error, recorded.path) from None
        if isinstance(e, OSError):
            raise write_failed(e, getattr(e, "filename", None) or path) from None
        raise
