"""A collective in flight, and the local step that completes it."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Pending", "AllWorks", "DONE"]


class Pending:
    """A collective in flight: ``wait()`` blocks until it is done, then runs ``then`` (the local
    step that completes it) once. Waiting again is a no-op."""

    def __init__(self, work: Any = None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


class AllWorks:
    """Several works waited for as one, in order."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


DONE = Pending()
DONE.done = True
