"""Progress of the long offline commands (reshard, export-hf, import-hf): what their workers report
as pieces done, turned into the ``progress(done, total)`` calls the caller asked for."""

from __future__ import annotations

from typing import Callable

__all__ = ["progress_adder"]


def progress_adder(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None]:
    """``add(n)``: ``n`` more of ``total`` done; calls ``progress(done, total)`` (when given)."""
    done = 0

    def add(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    return add
