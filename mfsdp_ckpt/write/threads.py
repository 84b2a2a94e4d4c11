"""Starting a writer's worker threads so that a Ctrl-C cannot leave one running unseen.

A pool of writer threads is stopped and joined on every path before its caller removes the
staging directory (a thread still writing there would recreate files in it, and a thread alive
at interpreter exit aborts the process inside C++). A ``KeyboardInterrupt`` that lands inside
``Thread.start()`` (while it waits for the new thread to run) leaves a thread that is running yet
cannot be joined (``join`` refuses a thread whose start has not been confirmed). So the threads
are started with a Ctrl-C deferred: noted, then handed to the handler that was in place once
every thread has started, where the pool's own clean-up sees it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Sequence

__all__ = ["start_all"]


def start_all(threads: Sequence[threading.Thread]) -> None:
    """Start every thread of ``threads``; a SIGINT meanwhile is passed on to the handler in place
    before (``KeyboardInterrupt``, as a rule) once all have started. Off the main thread (where
    Python runs no signal handler), just starts them."""
    if threading.current_thread() is not threading.main_thread():
        for t in threads:
            t.start()
        return
    came: list[FrameType | None] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(frame))
    try:
        for t in threads:
            t.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        if callable(previous):
            previous(signal.SIGINT, came[0])
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)
