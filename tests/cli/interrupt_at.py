"""``mfsdp-ckpt`` interrupted at a chosen moment: ``python -m tests.cli.interrupt_at COMMAND ...``
runs the command line (``cli.main``) after arranging that, at the moment ``MFSDP_TEST_INTERRUPT``
names, the process sends SIGINT to its own process group, as Ctrl-C in a terminal does:

* ``write:N`` -- inside the N-th write of output bytes: a call of the stream ``torch.save``
  writes a checkpoint's data file through (:class:`~mfsdp_ckpt.storage.write_errors.RecordingStream`,
  so the interrupt lands inside ``torch.save``), or a positional write of a safetensors file;
* ``staged`` -- just after the staging directory (``.<name>.partial-<id>``) is made, before its
  writer has taken charge of it;
* ``commit`` -- just before the staged output (a ``.partial-`` directory or file) is renamed into
  place;
* ``committed`` -- just after that rename (the output is committed: the command must say so and
  exit 0);
* ``timeline:FILE`` -- no interrupt: the moment (``time.monotonic()``, the same clock in every
  process) at which the command renamed its staged output into place is appended to FILE, as a
  line ``commit <seconds>``, so that a test can send a timed SIGINT from outside around it.

Deterministic where a timed signal is not: the signal is sent from inside the moment, and the
hook then waits for Python to run the handler there. Nothing in the package knows of it: the hook
wraps the writers from outside. A moment that never comes leaves the command to finish (exit 0).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any, Callable

INTERRUPT_ENV = "MFSDP_TEST_INTERRUPT"


def _interrupt(wait: float = 30.0) -> None:
    """SIGINT to the process group. On the main thread the handler raises ``KeyboardInterrupt``
    here, at the latest when the sleep (``wait`` seconds) is cut short by the signal; a worker
    thread goes on (the interrupt is raised in the main thread, wherever it is), as it would
    after a real Ctrl-C. A handler that raises nothing lets the sleep run to its end."""
    os.killpg(os.getpgrp(), signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        time.sleep(wait)


def _on_call(fn: Callable[..., Any], at: int, when: Callable[..., bool] = lambda *a: True) -> Callable[..., Any]:
    """``fn``, interrupted before its ``at``-th call that ``when`` accepts."""
    calls = [0]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args):
            calls[0] += 1
            if calls[0] == at:
                _interrupt()
        return fn(*args, **kwargs)

    return wrapper


def _staged(src: Any, *rest: Any) -> bool:
    from mfsdp_ckpt.storage.staging import is_partial_name

    return is_partial_name(os.path.basename(os.fspath(src)))


def _commits(src: Any, dst: Any, *rest: Any) -> bool:
    """Whether renaming ``src`` to ``dst`` commits an output: a staged one renamed to a place in no
    staging directory (not a file inside a staged output, such as its manifest)."""
    from mfsdp_ckpt.storage.staging import is_partial_name

    return _staged(src) and not any(is_partial_name(part) for part in os.path.abspath(os.fspath(dst)).split(os.sep))


def _after_call(fn: Callable[..., Any], when: Callable[..., bool], then: Callable[[], None]) -> Callable[..., Any]:
    """``fn``, with ``then()`` after each call that ``when`` accepts."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if when(*args):
            then()
        return out

    return wrapper


def arm(moment: str) -> None:
    """Wrap what ``moment`` names (see the module docstring)."""
    if moment.startswith("write:"):
        import mfsdp_ckpt.hf.files as hf_files
        from mfsdp_ckpt.storage.write_errors import RecordingStream

        at = int(moment.split(":", 1)[1])
        counted = _on_call(lambda f: f, at)  # one count shared by both kinds of write
        stream_write, pwrite = RecordingStream.write, hf_files.pwrite_tensor
        RecordingStream.write = lambda self, data: stream_write(self, counted(data))  # type: ignore[method-assign]
        hf_files.pwrite_tensor = lambda fd, tensor, offset: pwrite(fd, counted(tensor), offset)
    elif moment == "staged":
        import mfsdp_ckpt.write.destination as destination

        destination.make_partial_dir = _after_call(destination.make_partial_dir, lambda *a: True, _interrupt)
    elif moment == "commit":
        os.rename = _on_call(os.rename, 1, _staged)
        os.replace = _on_call(os.replace, 1, _staged)
    elif moment == "committed":
        os.rename = _after_call(os.rename, _commits, lambda: _interrupt(wait=1.0))
        os.replace = _after_call(os.replace, _commits, lambda: _interrupt(wait=1.0))
    elif moment.startswith("timeline:"):
        path = moment.split(":", 1)[1]

        def note() -> None:
            with open(path, "a") as f:
                f.write(f"commit {time.monotonic()}\n")

        os.rename = _after_call(os.rename, _commits, note)
        os.replace = _after_call(os.replace, _commits, note)
    else:
        raise ValueError(f"{INTERRUPT_ENV}={moment!r}: expected write:N, staged, commit, committed or timeline:FILE")


if __name__ == "__main__":
    arm(os.environ[INTERRUPT_ENV])
    from cli.main import main

    main()
