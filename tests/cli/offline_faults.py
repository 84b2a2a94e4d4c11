"""``mfsdp-ckpt`` with a process that dies or fails: ``python -m tests.cli.offline_faults COMMAND
...`` runs the command line (``cli.main``) after arranging that, as soon as it has finished
writing its first output file (a data file of a checkpoint, or a safetensors shard), the process
of rank ``MFSDP_TEST_KILL_RANK`` (torchrun's ``RANK``) SIGKILLs itself, as a machine that crashes
mid-job would, or the process of rank ``MFSDP_TEST_FAIL_RANK`` raises ``OSError(ENOSPC)``, as a
full disk would. Nothing in the package knows of it: the hook wraps the writers' ``close`` from
outside."""

from __future__ import annotations

import errno
import functools
import os
import signal
from typing import Any, Callable

from mfsdp_ckpt.hf.files import SafetensorsWriter
from mfsdp_ckpt.write.builder import ChunkFileWriter

KILL_RANK_ENV = "MFSDP_TEST_KILL_RANK"
FAIL_RANK_ENV = "MFSDP_TEST_FAIL_RANK"


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fail() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "injected by tests/cli/offline_faults.py")


def _after(close: Callable[..., Any], fault: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(close)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = close(*args, **kwargs)
        fault()
        return out

    return wrapper


def arm() -> None:
    """Wrap the writers' file-closing methods on the rank to be killed (or to fail)."""
    rank = os.environ.get("RANK")
    fault = _kill if rank == os.environ.get(KILL_RANK_ENV) else _fail if rank == os.environ.get(FAIL_RANK_ENV) else None
    if fault is not None:
        ChunkFileWriter.close_file = _after(ChunkFileWriter.close_file, fault)  # type: ignore[method-assign]
        SafetensorsWriter.close = _after(SafetensorsWriter.close, fault)  # type: ignore[method-assign]


if __name__ == "__main__":
    arm()
    from cli.main import main

    main()
