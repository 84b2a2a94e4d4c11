"""The asynchronous save this process has in flight (at most one), shared by ``async_save``, which
starts it, and ``save``, which waits for it first so that two saves never overlap."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["in_flight", "set_in_flight", "wait_for_async_save"]


class _Waitable(Protocol):
    def wait(self) -> None: ...


_handle: list[Any] = [None]  # the handle of the save in flight, or None


def in_flight() -> Any:
    """The handle of this process's asynchronous save in flight (done or not), or None."""
    return _handle[0]


def set_in_flight(handle: _Waitable | None) -> None:
    """Record ``handle`` as the save in flight (None: none is)."""
    _handle[0] = handle


def wait_for_async_save() -> None:
    """Wait for this process's asynchronous save in flight, if any, without raising (its
    handle reports the outcome)."""
    if _handle[0] is not None:
        _handle[0].wait()
