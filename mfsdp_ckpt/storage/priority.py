"""Lower the CPU and I/O priority of one thread: the background work of an asynchronous save.

An asynchronous save copies the state and writes it while training goes on, on the same cores
and the same disk. It should take only what training leaves idle, so its thread lowers itself
to nice 10 (as Megatron-Core's asynchronous checkpoint worker does) and to the idle I/O class
(``IOPRIO_CLASS_IDLE``: its requests are served when no one else's are waiting, where the I/O
scheduler honours classes).

On Linux both are attributes of a thread, not of the process: ``setpriority(PRIO_PROCESS, tid)``
and ``ioprio_set(IOPRIO_WHO_PROCESS, tid)`` with a thread id change that thread only, and a
thread created afterwards (DCP's writer threads, OpenMP's workers for an intra-op parallel op
run from that thread) starts with its creator's values (tests/mfsdp_ckpt/sharded/test_async_priority.py
checks both). The training thread and every thread it creates keep theirs. Raising one's own
nice value needs no privilege; lowering it again would, so the helpers are meant for a thread
that is discarded when its work is done.

Elsewhere (no ``os.setpriority``, no known ``ioprio`` syscall number) or when the kernel refuses
(a seccomp filter, ``EPERM``) the helpers do nothing and say so by returning False: a save is
never refused because its thread could not be deprioritised.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading

__all__ = [
    "BACKGROUND_NICE",
    "IOPRIO_CLASS_IDLE",
    "deprioritise_this_thread",
    "io_priority",
    "lower_cpu_priority",
    "lower_io_priority",
    "nice_of",
]

BACKGROUND_NICE = 10  #: the nice value of background checkpoint work (Megatron-Core's)

IOPRIO_CLASS_IDLE = 3  # the kernel's I/O classes: 0 none (from the nice value), 1 real-time, 2 best-effort, 3 idle
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread
#: (ioprio_set, ioprio_get) syscall numbers by machine (linux/arch/*/unistd)
_IOPRIO_SYSCALLS = {
    "x86_64": (251, 252),
    "amd64": (251, 252),
    "aarch64": (30, 31),
    "arm64": (30, 31),
    "ppc64le": (273, 274),
    "s390x": (282, 283),
}


def _tid(tid: int | None) -> int:
    """``tid`` or the calling thread's native id (passed explicitly rather than 0, which the
    kernel also reads as the calling thread, so that the call says what it changes)."""
    return threading.get_native_id() if tid is None else tid


def nice_of(tid: int | None = None) -> int | None:
    """The nice value of thread ``tid`` (default: the calling thread), or None where it cannot
    be read."""
    if not sys.platform.startswith("linux") or not hasattr(os, "getpriority"):
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, _tid(tid))
    except OSError:
        return None


def lower_cpu_priority(nice: int = BACKGROUND_NICE, tid: int | None = None) -> bool:
    """Raise thread ``tid``'s nice value (default: the calling thread's) to at least ``nice``;
    whether it now is. Never lowers it (that needs a privilege) and never raises."""
    current = nice_of(tid)
    if current is None:
        return False
    if current >= nice:
        return True
    try:
        os.setpriority(os.PRIO_PROCESS, _tid(tid), nice)
    except OSError:
        return False
    return True


def _syscall() -> tuple[ctypes.CDLL, int, int] | None:
    """libc and the (ioprio_set, ioprio_get) numbers of this machine, or None."""
    numbers = _IOPRIO_SYSCALLS.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
    if numbers is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc, numbers[0], numbers[1]


def io_priority(tid: int | None = None) -> tuple[int, int] | None:
    """``(class, level)`` of thread ``tid``'s I/O priority (default: the calling thread's;
    class 0, none, means derived from its nice value), or None where it cannot
    be read."""
    found = _syscall()
    if found is None:
        return None
    libc, _, get = found
    value = libc.syscall(get, _IOPRIO_WHO_PROCESS, _tid(tid))
    if value < 0:
        return None
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


def lower_io_priority(tid: int | None = None) -> bool:
    """Put thread ``tid`` (default: the calling thread) in the idle I/O class; whether it now
    is. Never raises."""
    found = _syscall()
    if found is None:
        return False
    libc, set_, _ = found
    if libc.syscall(set_, _IOPRIO_WHO_PROCESS, _tid(tid), IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) != 0:
        return False
    return True


def deprioritise_this_thread(nice: int = BACKGROUND_NICE) -> tuple[bool, bool]:
    """Lower the calling thread to nice ``nice`` and the idle I/O class, for itself and the
    threads it creates from now on; whether each was done. Call it first thing in a thread of
    its own (never in the training thread: the change cannot be undone without a privilege)."""
    return lower_cpu_priority(nice), lower_io_priority()
