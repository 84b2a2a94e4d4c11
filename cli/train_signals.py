"""Stopping a training run cleanly on a signal, on every rank at the same step.

Ctrl-C (SIGINT) and a scheduler's preemption notice (SIGTERM) do not stop a rank where it is: a
rank torn out of a collective leaves the others waiting in it, and each prints its own traceback.
Instead the handler only notes the signal; at the end of each step the ranks add up what they
noted (one small all-reduce, folded into the loss's) and all stop after that same step. SIGTERM
then saves a checkpoint of that step before the run exits, as Megatron-LM's
``--exit-signal-handler`` does; SIGINT does not. A second signal, given more than a moment after
the first (a launcher forwards the terminal's Ctrl-C to its workers, which then see it twice at
once), stops the process at once.

Before the training loop (``step`` still 0: the model built, the checkpoint loaded, the ranks
meeting), a Ctrl-C stops the rank at once (``KeyboardInterrupt``): there is no step to finish,
and a rank that went on would wait in a collective for peers the same Ctrl-C has stopped. In the
loop, rank 0 of ``mfsdp-train --nproc-per-node`` that notes a Ctrl-C creates the file
``MFSDP_TRAIN_STOP_SAID`` names: it will print where the run stopped, and the launcher, which
says ``error: interrupted`` for a job whose ranks stopped before the loop, then says nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time

TYPE_CHECKING = False  # typing's own import is too slow for the first module a Ctrl-C may meet
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType
    from typing import NoReturn, TypeVar

    T = TypeVar("T")

__all__ = [
    "StopRequests",
    "EXIT_CODES",
    "PEER_LOST_EXIT",
    "peer_lost",
    "LAUNCHED_ENV",
    "exit_interrupted",
    "interruptible",
    "with_sigint_held",
    "launched_by_us",
    "says_for_the_job",
    "STOP_SAID_ENV",
    "stop_signal",
    "note_sigint",
    "raise_if_sigint_noted",
    "sigint_noted",
]

# the exit status of a run stopped by the signal, as a shell reports a process killed by it
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
_SECOND_SIGNAL_AFTER_S = 1.0
#: the file rank 0 creates when it notes a Ctrl-C in the training loop (set by the launcher)
STOP_SAID_ENV = "MFSDP_TRAIN_STOP_SAID"
LAUNCHED_ENV = "MFSDP_TRAIN_LAUNCHED"  # set for the ranks ``mfsdp-train --nproc-per-node`` starts
#: the exit status of a rank of our launcher that stopped because another rank's connection
#: closed under it (that rank died): it prints nothing, the launcher names the rank that failed
PEER_LOST_EXIT = 3
#: what gloo's transport says when the process at the other end of a connection is gone
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def launched_by_us() -> bool:
    """Whether this process is a rank that ``mfsdp-train --nproc-per-node`` started."""
    return os.environ.get(LAUNCHED_ENV) == "1"


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer process is gone (its connection
    closed or reset), rather than a fault of this rank."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _PEER_GONE)


def interruptible(fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread of its own while this (main) thread waits in short slices, so that
    a Ctrl-C ends the process even while ``fn`` waits inside a C++ call, where Python cannot run
    a signal handler: joining the process group waits there for every peer, and one that a
    Ctrl-C has already stopped never comes (the rank then waited for the launcher's
    ``--shutdown-timeout``, two minutes, before it was killed). The Ctrl-C ends the process at
    once (:func:`exit_interrupted`); an error of ``fn`` is raised here."""
    import threading  # only a rank needs it

    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            outcome.append((False, e))

    worker = threading.Thread(target=target, name="mfsdp-interruptible", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        exit_interrupted(say=says_for_the_job())  # os._exit: the thread may still be inside C++
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def says_for_the_job() -> bool:
    """Whether this process reports an interrupt itself: a lone process, the launcher, or rank 0
    of a plain torchrun job (a rank of our own launcher leaves it to the launcher)."""
    return not launched_by_us() and os.environ.get("RANK", "0") == "0"


def exit_interrupted(say: bool) -> NoReturn:
    """End the process after a Ctrl-C: ``error: interrupted`` (when ``say``), exit code 130.

    Through ``os._exit``, output flushed first: CPython ends a process whose
    ``KeyboardInterrupt`` went unhandled by killing itself with SIGINT at exit, and a launcher
    that had printed its line and returned 130 after a Ctrl-C during an import was seen to end
    that way (exit status -2 to its parent, in 4 of 20 runs interrupted about 1 s in)."""
    if say:
        print("error: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def _exit_on_escaped_interrupt() -> None:
    """From now on a ``KeyboardInterrupt`` that escapes every handler (one raised while the
    trainer's own modules are still being imported, before ``main`` runs) ends the process as
    :func:`exit_interrupted` does, not with a traceback of the import machinery. Installed
    as this module's import ends (below), which is the first thing the trainer's entry module
    does: what remains before it is the interpreter's own start-up and this module's body."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            exit_interrupted(say=says_for_the_job())
        previous(kind, value, tb)

    sys.excepthook = excepthook


def with_sigint_held(load: Callable[[], T]) -> T:
    """``load()`` (an import of torch) with SIGINT held back, then delivered as usual.

    A ``KeyboardInterrupt`` raised inside torch's import can meet a C++ callback that cannot
    pass it on: the process aborts (``terminate called after throwing ... KeyboardInterrupt``,
    SIGABRT). Held back, a Ctrl-C waits until the import is done and is raised right after it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return load()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_sigint_noted = False  # set by _noting_handler: a Ctrl-C came before StopRequests took over


def _noting_handler(signum: int, frame: FrameType | None) -> None:
    """Python's own SIGINT handler (raise ``KeyboardInterrupt``), noting that it came."""
    global _sigint_noted
    _sigint_noted = True
    raise KeyboardInterrupt


def note_sigint() -> None:
    """From now on, until :meth:`StopRequests.install`, a SIGINT raises ``KeyboardInterrupt`` as
    usual and is also noted: an import that swallows the interrupt (torch's C extension clears a
    failed import's error) must not make the process go on as if no Ctrl-C had come."""
    signal.signal(signal.SIGINT, _noting_handler)


def sigint_noted() -> bool:
    """Whether a SIGINT came since :func:`note_sigint`."""
    return _sigint_noted


def raise_if_sigint_noted() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT came since :func:`note_sigint` (whether or not
    its ``KeyboardInterrupt`` reached anyone)."""
    if _sigint_noted:
        raise KeyboardInterrupt


class StopRequests:
    """The signals this process has received since :meth:`install`: ``pending()`` says which
    (as a vector the ranks sum), ``install`` / ``uninstall`` put the handlers in place and back."""

    def __init__(self) -> None:
        self.received: dict[int, float] = {}
        self.step = 0  # the step the run is in (what an interrupt reports)
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (the main thread only: Python's rule); a Ctrl-C
        noted before (:func:`note_sigint`) and swallowed on the way is raised here."""
        raise_if_sigint_noted()
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.step == 0:
            raise KeyboardInterrupt  # before the loop: nothing to finish (see the module docstring)
        first = self.received.get(signum)
        now = time.monotonic()
        if first is not None and now - first > _SECOND_SIGNAL_AFTER_S:
            raise KeyboardInterrupt  # the second request: stop here, now
        if first is None and signum == signal.SIGINT:
            _tell_the_launcher()
        self.received.setdefault(signum, now)

    def pending(self) -> list[float]:
        """``[SIGINT received, SIGTERM received]`` as 0.0 / 1.0, the order :func:`stop_signal` reads."""
        return [float(signal.SIGINT in self.received), float(signal.SIGTERM in self.received)]


def _tell_the_launcher() -> None:
    """On rank 0 of our launcher's job: create the file :data:`STOP_SAID_ENV` names (rank 0 will
    say where the run stopped; the launcher need not)."""
    path = os.environ.get(STOP_SAID_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            with open(path, "w"):
                pass
        except OSError:
            pass  # the launcher then says "error: interrupted" as well: two lines, not none


def stop_signal(summed: list[float]) -> signal.Signals | None:
    """The signal the ranks stop for, from the sum of their :meth:`StopRequests.pending`: SIGTERM
    when any rank got it (the run must save before it goes), else SIGINT when any did, else None."""
    if summed[1] > 0:
        return signal.SIGTERM
    if summed[0] > 0:
        return signal.SIGINT
    return None


# at the end of this module's import, not by its importer after it: a Ctrl-C between the two
# (a test that signals the moment the import is complete met it there) escaped as a traceback
_exit_on_escaped_interrupt()
