"""Stopping a training run cleanly on a signal, on every rank at the same step.

Ctrl-C (SIGINT) and a scheduler's preemption notice (SIGTERM) do not stop a rank where it is: a
rank torn out of a collective leaves the others waiting in it, and each prints its own traceback.
Instead the handler only notes the signal; at the end of each step the ranks add up what they
noted (one small all-reduce, folded into the loss's) and all stop after that same step. SIGTERM
then saves a checkpoint of that step before the run exits, as Megatron-LM's
``--exit-signal-handler`` does; SIGINT does not. A second signal, given more than a moment after
the first (a launcher forwards the terminal's Ctrl-C to its workers, which then see it twice at
once), stops the process at once.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

__all__ = ["StopRequests", "EXIT_CODES", "stop_signal"]

# the exit status of a run stopped by the signal, as a shell reports a process killed by it
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
_SECOND_SIGNAL_AFTER_S = 1.0


class StopRequests:
    """The signals this process has received since :meth:`install`: ``pending()`` says which
    (as a vector the ranks sum), ``install`` / ``uninstall`` put the handlers in place and back."""

    def __init__(self) -> None:
        self.received: dict[int, float] = {}
        self.step = 0  # the step the run is in (what an interrupt reports)
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (the main thread only: Python's rule)."""
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received.get(signum)
        now = time.monotonic()
        if first is not None and now - first > _SECOND_SIGNAL_AFTER_S:
            raise KeyboardInterrupt  # the second request: stop here, now
        self.received.setdefault(signum, now)

    def pending(self) -> list[float]:
        """``[SIGINT received, SIGTERM received]`` as 0.0 / 1.0, the order :func:`stop_signal` reads."""
        return [float(signal.SIGINT in self.received), float(signal.SIGTERM in self.received)]


def stop_signal(summed: list[float]) -> signal.Signals | None:
    """The signal the ranks stop for, from the sum of their :meth:`StopRequests.pending`: SIGTERM
    when any rank got it (the run must save before it goes), else SIGINT when any did, else None."""
    if summed[1] > 0:
        return signal.SIGTERM
    if summed[0] > 0:
        return signal.SIGINT
    return None
