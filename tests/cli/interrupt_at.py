"""``mfsdp-ckpt`` interrupted at a chosen moment: ``python -m tests.cli.interrupt_at COMMAND ...``
runs the command line (``cli.main``) after arranging that, at the moment ``MFSDP_TEST_INTERRUPT``
names, the process sends SIGINT to its own process group, as Ctrl-C in a terminal does:

* ``write:N`` -- inside the N-th write of output bytes: a call of the stream ``torch.save``
  writes a checkpoint's data file through (:class:`~mfsdp_ckpt.storage.write_errors.RecordingStream`,
  so the interrupt lands inside ``torch.save``), or a positional write of a safetensors file;
* ``commit`` -- just before the staged output (a ``.partial-`` directory or file) is renamed into
  place.

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


def _interrupt() -> None:
    """SIGINT to the process group. On the main thread the handler raises ``KeyboardInterrupt``
    here, at the latest when the sleep is cut short by the signal; a worker thread goes on (the
    interrupt is raised in the main thread, wherever it is), as it would after a real Ctrl-C."""
    os.killpg(os.getpgrp(), signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        time.sleep(30)


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
    elif moment == "commit":
        os.rename = _on_call(os.rename, 1, _staged)
        os.replace = _on_call(os.replace, 1, _staged)
    else:
        raise ValueError(f"{INTERRUPT_ENV}={moment!r}: expected write:N or commit")


if __name__ == "__main__":
    arm(os.environ[INTERRUPT_ENV])
    from cli.main import main

    main()
