"""The background work of an asynchronous save yields to training: its thread, the threads it
starts (DCP's writer threads) and the gloo threads of the checkpoint traffic's own group run at
nice >= 10 in the idle I/O class, while the caller's
thread, the process's torch thread count and a synchronous ``save`` keep their priority; the
checkpoints still round-trip bitwise. Read from the kernel (``/proc/self/task/<tid>/stat`` and
``ioprio_get``), not from what the helpers say they did."""

from __future__ import annotations

import importlib
import os
import sys
import threading

import pytest
import torch

import mfsdp_ckpt
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.storage import priority
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps

ASYNC = importlib.import_module("mfsdp_ckpt.sharded.async_save")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _priority(tid: int) -> tuple[int, tuple[int, int] | None]:
    """(nice, (I/O class, level)) of thread ``tid`` of this process, read from the kernel: the
    nice value is field 19 of ``/proc/self/task/<tid>/stat``."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd on (the name may hold spaces)
    return int(fields[19 - 3]), priority.io_priority(tid)


def _here() -> tuple[int, tuple[int, int] | None]:
    return _priority(threading.get_native_id())


def _require_support() -> None:
    """Skip where this kernel does not let a thread lower itself (the helpers then do nothing)."""
    done: list[tuple[bool, bool]] = []
    t = threading.Thread(target=lambda: done.append(priority.deprioritise_this_thread()))
    t.start()
    t.join()
    if done != [(True, True)]:
        pytest.skip(f"this kernel refuses lowering a thread's priority: {done}")


def test_a_lowered_thread_and_its_children_yield_and_the_caller_keeps_its_priority():
    _require_support()
    caller, threads = _here(), torch.get_num_threads()
    seen = {}

    def child() -> None:
        seen["child"] = _here()

    def background() -> None:
        seen["before"] = _here()
        seen["done"] = priority.deprioritise_this_thread()
        seen["after"] = _here()
        t = threading.Thread(target=child)  # started afterwards: inherits both
        t.start()
        t.join()

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen["done"] == (True, True)
    assert seen["before"] == caller  # a new thread starts with its creator's priority
    for who in ("after", "child"):
        nice, io = seen[who]
        assert nice >= priority.BACKGROUND_NICE, (who, nice)
        assert io is not None and io[0] == priority.IOPRIO_CLASS_IDLE, (who, io)
    assert _here() == caller and torch.get_num_threads() == threads


def test_the_helpers_never_raise_and_never_raise_a_priority():
    nice = priority.nice_of()
    assert priority.lower_cpu_priority(nice=-5) is (nice is not None)  # already lower: nothing to do
    assert priority.nice_of() == nice
    assert priority.nice_of(tid=2**30) is None and priority.io_priority(tid=2**30) is None  # no such thread
    assert priority.lower_io_priority(tid=2**30) is False
    assert priority.lower_cpu_priority(tid=2**30) is False


def _record_writers(seen: list) -> object:
    """Patch the save planner so that every thread resolving a chunk for the writer (the threads
    that serialize and write it) records its priority; returns the original method."""
    real = MfsdpSavePlanner.resolve_data

    def resolve_data(self, write_item):
        seen.append((threading.get_native_id(), _here()))
        return real(self, write_item)

    MfsdpSavePlanner.resolve_data = resolve_data
    return real


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's threads (they carry its bytes)


def _gloo_threads() -> dict[int, tuple[int, tuple[int, int] | None]]:
    """This process's gloo threads now: thread id -> priority."""
    out = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in GLOO_THREADS:
                    out[tid] = _priority(tid)
        except FileNotFoundError:  # ended meanwhile
            pass
    return out


def _priorities_in_a_save(root: str) -> dict:
    model, optim = build("optim_grads", "even")
    train_steps(model, optim, 0, 2)
    caller, threads = _here(), torch.get_num_threads()
    training_gloo = _gloo_threads()
    state = owned_pieces(model, optim)
    async_writers: list = []
    sync_writers: list = []
    background: list = []
    real_write = ASYNC.write_save

    def write_save(*args, **kwargs):
        background.append((threading.get_native_id(), _here()))
        return real_write(*args, **kwargs)

    real_resolve = _record_writers(async_writers)
    ASYNC.write_save = write_save
    try:
        handle = mfsdp_ckpt.async_save(os.path.join(root, "async", "step_2"), model, optim, step=2, thread_count=2)
        during = _here()
        handle.result()
        all_gloo = _gloo_threads()
        MfsdpSavePlanner.resolve_data = real_resolve
        _record_writers(sync_writers)
        mfsdp_ckpt.save(os.path.join(root, "sync", "step_2"), model, optim, step=2, thread_count=2)
    finally:
        MfsdpSavePlanner.resolve_data = real_resolve
        ASYNC.write_save = real_write
    fresh, fresh_optim = build("optim_grads", "even", seed=7)
    mfsdp_ckpt.load(os.path.join(root, "async", "step_2"), fresh, fresh_optim)
    got = owned_pieces(fresh, fresh_optim)
    return {
        "caller": caller,
        "during": during,
        "after": _here(),
        "threads": (threads, torch.get_num_threads()),
        "me": threading.get_native_id(),
        "background": background,
        "async_writers": async_writers,
        "sync_writers": sync_writers,
        "mismatches": [k for k, (_, _, v) in state.items() if not torch.equal(got[k][2], v)],
        "training_gloo": [all_gloo[t] for t in training_gloo],
        "checkpoint_gloo": [p for t, p in all_gloo.items() if t not in training_gloo],
    }


def test_the_background_write_yields_and_the_caller_and_a_sync_save_do_not(ranks, tmp_path):
    _require_support()
    out = ranks(_priorities_in_a_save, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(out):
        assert r["during"] == r["caller"] == r["after"], (rank, r["caller"], r["during"], r["after"])
        assert r["threads"][0] == r["threads"][1], (rank, r["threads"])
        ((tid, (nice, io)),) = r["background"]
        assert tid != r["me"]
        assert nice >= priority.BACKGROUND_NICE and io[0] == priority.IOPRIO_CLASS_IDLE, (rank, nice, io)
        assert r["async_writers"], rank  # (with thread_count=2 DCP starts a writer thread from the background one)
        for t, (nice, io) in r["async_writers"]:
            assert nice >= priority.BACKGROUND_NICE and io[0] == priority.IOPRIO_CLASS_IDLE, (rank, t, nice, io)
        assert r["sync_writers"] and all(p == r["caller"] for _, p in r["sync_writers"]), (rank, r["sync_writers"])
        assert not r["mismatches"], (rank, r["mismatches"][:5])
        # the checkpoint traffic's own group: its gloo threads yield too, the training group's do not
        assert r["training_gloo"] and all(p == r["caller"] for p in r["training_gloo"]), (rank, r["training_gloo"])
        assert r["checkpoint_gloo"], rank
        for nice, io in r["checkpoint_gloo"]:
            assert nice >= priority.BACKGROUND_NICE and io[0] == priority.IOPRIO_CLASS_IDLE, (rank, nice, io)
    a, s = str(tmp_path / "async" / "step_2"), str(tmp_path / "sync" / "step_2")
    assert verify_checkpoint(a) == [] and verify_checkpoint(s) == []
    assert diff_checkpoints(a, s).equal


def test_recording_stream_hands_at_most_max_write_bytes_per_call():
    import io

    from mfsdp_ckpt.storage.write_errors import RecordingStream

    calls = []

    class Sink(io.BytesIO):
        def write(self, data):
            calls.append(len(memoryview(data).cast("B")))
            return super().write(data)

    sink = Sink()
    stream = RecordingStream(sink, "x", max_write=4)
    assert stream.write(b"0123456789") == 10
    assert calls == [4, 4, 2] and sink.getvalue() == b"0123456789"
    RecordingStream(sink, "x").write(b"abcdef")
    assert calls[-1] == 6
