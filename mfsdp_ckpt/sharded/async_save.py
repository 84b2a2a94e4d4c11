"""Asynchronous save: check, return to training, copy the state and write it in the background.

``async_save`` does everything ``save`` does before writing in the calling thread (every refusal,
the destination's checks, the run directory's lock, the entries and the manifest: the same code,
:func:`~mfsdp_ckpt.sharded.save.prepare_save`), copies the small values (RNG states, extras, the
optimizer's groups and scalars) and returns a :class:`AsyncSaveHandle`. A background thread then
copies the sharded state (weights, main params, optimizer state, planes, gradients) into a host
staging buffer (:class:`HostStaging`; the only part that grows with the state), runs DCP's save
on the staged copy with our writer, planner, manifest and commit
(:func:`~mfsdp_ckpt.sharded.save.write_save`), moves ``latest`` and prunes, exactly as
``save`` does; the result is indistinguishable from a synchronous checkpoint of the state at the
call.

Why the copy may run while training goes on: the next forward and backward only read the state.
Every write the runtime does to it waits until the copy is complete: a
:class:`~mfsdp_core.fence.Fence` on the model's buffers (the optimizer step, refreshing the
compute params, a load, and with ``include_grads`` the gradient reduction, ``clip_grad_norm_``
and ``zero_grad(set_to_none=False)``). Once the copy is done the fence is gone. The handle counts
the time a write waited there as time the save blocked training.

Why a process group of its own: DCP's save runs collectives (the plan's gather and scatter, the
final reduction). Run from a background thread on the training's process group they would
interleave with the training loop's collectives in an order that differs between ranks, which
breaks gloo and NCCL alike. The background work therefore uses a dedicated gloo group (created
once, collectively, by the first ``async_save``, which every rank calls at the same point of its
loop), as ``torch.distributed.checkpoint.async_save`` does with its ``process_group``.

Why the background yields: it shares the cores, the memory bandwidth and the disk with
training, and a save that slows training by more than a synchronous save would take is no gain.
The background thread therefore lowers itself, first thing, to nice 10 and the idle I/O class
(:mod:`mfsdp_ckpt.storage.priority`; per thread on Linux, inherited by the threads it starts:
DCP's writer threads, OpenMP's workers), so that it runs on what training leaves idle; the
caller's thread, the process's torch thread count and a synchronous ``save`` keep their
priority. The copy goes in pieces of :data:`COPY_CHUNK_BYTES` on that one thread, and the
write hands the kernel at most :data:`WRITE_CHUNK_BYTES` per call (``CommittingWriter.bound_writes``), so
that a training thread woken meanwhile gets its core back within a fraction of a millisecond.

At most one save is in flight: the next ``async_save`` (and a synchronous ``save``) first waits
for it, so that one host buffer serves every save and checkpoints commit in call order.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import SavePlan

from mfsdp_ckpt.errors import CheckpointError, one_line
from mfsdp_ckpt.sharded.in_flight import in_flight, set_in_flight
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.sharded.save import check_save_arguments, prepare_save, write_save
from mfsdp_ckpt.sharded.state import FlatEntry
from mfsdp_ckpt.storage.priority import deprioritise_this_thread
from mfsdp_ckpt.write.agreement import agreed
from mfsdp_core.collectives import rank0_decides
from mfsdp_core.fence import Fence
from mfsdp_core.fully_shard import buffers_of

__all__ = ["AsyncSaveHandle", "HostStaging", "async_save", "async_write", "staging_bytes"]

#: what the background thread runs once the state is staged: write ``entries`` (the staged copy)
#: with ``planner`` over the checkpoint traffic's ``group``, and commit
BackgroundWrite = Callable[[dict[str, Any], MfsdpSavePlanner, dist.ProcessGroup | None], None]
GROUP_DESC = "mfsdp_ckpt_async_save"  # the description of the dedicated process group
_ALIGN = 64  # bytes: every staged tensor starts on a 64-byte boundary of the buffer
#: the background copy's piece: small enough that training's own memory traffic is never held
#: off for long (a piece takes ~3 ms at the ~11 GB/s one core copies), large enough that the
#: per-piece overhead is nothing
COPY_CHUNK_BYTES = 32 << 20
#: the background write's largest ``write`` call: the kernel copies a write into the page cache
#: without a point where a waking training thread could take the core back (a kernel built with
#: ``PREEMPT_NONE``), so one call of a whole chunk (tens of MiB) holds a core for tens of ms
WRITE_CHUNK_BYTES = 1 << 20


class AsyncSaveHandle:
    """One asynchronous save. ``result()`` waits for its commit and returns the checkpoint
    directory, or raises its one-line :class:`CheckpointError` (every rank the same one).

    ``blocked_s``: seconds the save kept training from going on, ``call_s + fence_s``;
    ``call_s``: seconds ``async_save`` kept the caller (waiting for the previous save, the
    checks); ``waited_s``: of which waiting for the previous save; ``fence_s``: seconds the
    runtime's writes of the state (the optimizer step, …) waited for the background copy (grows
    until the copy is done); ``staged_s``: seconds from the call to the end of that copy, None
    until then; ``total_s``: seconds from the call to the commit (``latest`` moved, pruned), None
    until done."""

    def __init__(self, path: str, started: float) -> None:
        self.path = path
        self.call_s = 0.0
        self.waited_s = 0.0
        self.staged_s: float | None = None
        self.total_s: float | None = None
        self._started = started
        self._fence: Fence | None = None
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: CheckpointError | None = None
        self._reported = False

    @property
    def fence_s(self) -> float:
        """Seconds the runtime's writes of the state waited for the background copy (so far)."""
        return 0.0 if self._fence is None else self._fence.waited_s

    @property
    def blocked_s(self) -> float:
        """Seconds this save kept training from going on: the call plus the waits at the fence."""
        return self.call_s + self.fence_s

    def done(self) -> bool:
        """Whether the background write has finished (committed or failed); never blocks."""
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the state is copied (the fence released); whether it is. Call it before
        writing the model's or optimizer's tensors yourself (the runtime's own writes wait
        anyway)."""
        return self._staged.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background write to finish (without raising); whether it has."""
        return self._done.wait(timeout)

    def exception(self) -> CheckpointError | None:
        """Wait, then the save's error (None: committed). Does not count as reporting it."""
        self._done.wait()
        return self._error

    def result(self) -> str:
        """Wait; return the committed checkpoint's directory or raise the save's error."""
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise self._error.with_traceback(None)
        return self.path

    def _mark_staged(self) -> None:
        self.staged_s = time.perf_counter() - self._started
        self._staged.set()

    def _finish(self, error: CheckpointError | None) -> None:
        self._error = error
        self.total_s = time.perf_counter() - self._started
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"AsyncSaveHandle({self.path!r}, {state})"


@dataclasses.dataclass
class _Staged:
    """A save's staged copy: the entries DCP writes (``entries``; the flat ranges are regions of
    the staging buffer, filled by :meth:`HostStaging.fill`), the live tensors' properties by key,
    the ``(target, source)`` pairs left to copy, and, on a GPU, the event after which the sources
    hold the state of the call."""

    entries: dict[str, Any]
    properties: dict[str, TensorProperties]
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    ready: Any = None  # torch.cuda.Event, recorded on the caller's stream


class HostStaging:
    """Host copies of every tensor a save writes, in one buffer that is allocated for a layout
    (the keys, dtypes, shapes and owned ranges of the entries) and reused by every save with the
    same layout; a new layout replaces it. Pinned when the state is on a GPU (so the copy is a
    DMA, on a stream of its own); ordinary memory otherwise.

    Each staged tensor, and each box (chunk) of a staged flat range, is a tensor whose storage
    is exactly its own bytes of the buffer: DCP's writer copies a tensor whose storage is larger
    than the tensor before ``torch.save`` (which would write the whole storage), and this way it
    writes straight from the buffer, so the extra host memory stays the state's bytes."""

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._pinned = False
        self._buffer: torch.Tensor | None = None
        self._staged: dict[str, Any] = {}
        self._stream: Any = None  # the copy's CUDA stream, created at the first pinned copy

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffer (0 before the first save)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def stage(self, entries: dict[str, Any]) -> _Staged:
        """A copy of ``entries`` that no later change of the live state affects once
        :meth:`fill` has run: the flat ranges (the runtime's sharded state, whose writes the
        fence holds back) are left to :meth:`fill`; other tensors (RNG states, tensor extras,
        optimizer scalars) are copied now, other values deep-copied now (``param_groups``,
        extras: nothing holds back their changes). Also the properties of the live tensors by
        key (what the checkpoint's metadata records, so that a pinned buffer leaves no trace in
        it)."""
        layout, pinned = _layout_of(entries)
        if layout != self._layout or pinned != self._pinned:
            self._allocate(layout, pinned)
        staged: dict[str, Any] = {}
        properties: dict[str, TensorProperties] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, value in entries.items():
            if isinstance(value, FlatEntry):
                target = self._staged[key]
                copies.append((target.tensor, value.tensor[: value.end - value.start]))
                staged[key] = target
                properties[key] = TensorProperties.create_from_tensor(value.tensor)
            elif isinstance(value, torch.Tensor):
                target = self._staged[key]
                target.copy_(value.detach())
                staged[key] = target
                properties[key] = TensorProperties.create_from_tensor(value)
            else:
                staged[key] = copy.deepcopy(value)
        ready = None
        if pinned:
            ready = torch.cuda.Event()
            ready.record()  # the state of the call: what the caller's stream has written so far
        return _Staged(staged, properties, copies, ready)

    def fill(self, staged: _Staged) -> None:
        """Copy the flat ranges of ``staged`` into the buffer; returns once the copy is complete.
        Runs in the background thread, in pieces of at most :data:`COPY_CHUNK_BYTES`: on the host
        one piece at a time on this thread alone (:func:`_copy_host`), so that the copy never
        takes more than one core, nor the memory bandwidth for long, from training; on a GPU,
        as DMAs on a stream of its own after the caller's stream reached the call."""
        if staged.ready is None:
            for target, source in staged.copies:
                _copy_host(target, source)
            return
        device = staged.copies[0][1].device if staged.copies else torch.device("cuda", torch.cuda.current_device())
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(staged.ready)
            for target, source in staged.copies:
                for lo, hi in _pieces(target):
                    target[lo:hi].copy_(source[lo:hi], non_blocking=True)
        self._stream.synchronize()

    def _allocate(self, layout: tuple, pinned: bool) -> None:
        self._buffer, self._staged, self._layout = None, {}, None  # the old buffer goes first
        sizes = [_nbytes(item) for item in layout]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
        raw = buffer.numpy()
        for item, offset, n in zip(layout, offsets, sizes):
            key, kind, dtype, shape = item[:4]

            def region(lo: int, hi: int, dtype: torch.dtype = dtype, offset: int = offset) -> torch.Tensor:
                # from_numpy: a tensor whose storage is exactly these bytes (see the class docstring)
                return torch.from_numpy(raw[offset + lo : offset + hi]).view(dtype)

            if kind == "tensor":
                self._staged[key] = region(0, n).view(shape)
                continue
            start, end = item[4], item[5]
            entry = _StagedEntry(torch.Size(shape), start, end, region(0, n))
            size = dtype.itemsize
            for box in entry.boxes():
                lo = (box.flat_start - start) * size
                entry.pieces[box.offsets] = region(lo, lo + box.numel * size).view(box.sizes)
            self._staged[key] = entry
        self._buffer, self._layout, self._pinned = buffer, layout, pinned


@dataclasses.dataclass
class _StagedEntry(FlatEntry):
    """A staged flat range: each box is its own tensor (see :class:`HostStaging`)."""

    pieces: dict[tuple[int, ...], torch.Tensor] = dataclasses.field(default_factory=dict)

    def view(self, box: Any) -> torch.Tensor:
        return self.pieces[box.offsets]


def _layout_of(entries: dict[str, Any]) -> tuple[tuple, bool]:
    """The staging layout of ``entries`` (one item per tensor to copy) and whether any of them is
    on a GPU (then the buffer is pinned)."""
    items = []
    on_gpu = False
    for key, value in entries.items():
        if isinstance(value, FlatEntry):
            t = value.tensor
            items.append((key, "flat", t.dtype, tuple(value.shape), value.start, value.end))
        elif isinstance(value, torch.Tensor):
            t = value
            items.append((key, "tensor", t.dtype, tuple(t.shape)))
        else:
            continue
        on_gpu = on_gpu or t.is_cuda
    return tuple(items), on_gpu and torch.cuda.is_available()


def _nbytes(item: tuple) -> int:
    _, kind, dtype, shape = item[:4]
    numel = item[5] - item[4] if kind == "flat" else torch.Size(shape).numel()
    return numel * dtype.itemsize


def _pieces(target: torch.Tensor) -> list[tuple[int, int]]:
    """``(lo, hi)`` element ranges of the 1-D ``target``, each at most :data:`COPY_CHUNK_BYTES`."""
    step = max(1, COPY_CHUNK_BYTES // max(1, target.element_size()))
    return [(lo, min(lo + step, target.numel())) for lo in range(0, target.numel(), step)]


def _copy_host(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` on the host, in pieces of at most :data:`COPY_CHUNK_BYTES`, on
    the calling thread only: as bytes with numpy (one thread, the GIL released) rather than
    torch's ``copy_``, which from a thread of its own fans out over as many OpenMP workers as
    torch's thread count (at this thread's lowered priority, but on every core at once)."""
    if source.device.type != "cpu" or not (source.is_contiguous() and target.is_contiguous()):
        for lo, hi in _pieces(target):  # not expected for a flat range; correct anyway
            target[lo:hi].copy_(source[lo:hi])
        return
    dst = target.view(torch.uint8).numpy()
    src = source.detach().view(torch.uint8).numpy()
    step = COPY_CHUNK_BYTES
    for lo in range(0, dst.size, step):
        numpy.copyto(dst[lo : lo + step], src[lo : lo + step])


class _StagedSavePlanner(MfsdpSavePlanner):
    """Our save planner on the staged copy, recording the live tensors' properties (dtype,
    layout, ``pin_memory``, …) so that ``.metadata`` is what a synchronous save writes."""

    def __init__(self, properties: dict[str, TensorProperties]) -> None:
        super().__init__()
        self._properties = properties
        self.failure: CheckpointError | None = None  # this rank's copy failed: raised while planning

    def create_local_plan(self) -> SavePlan:
        if self.failure is not None:  # DCP gathers it: every rank fails the save with it, none goes on alone
            raise self.failure
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            props = self._properties.get(item.index.fqn)
            if item.tensor_data is not None and props is not None:
                item = dataclasses.replace(item, tensor_data=dataclasses.replace(item.tensor_data, properties=props))
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan


class _AsyncState:
    """This process's asynchronous saving: the staging buffer (the save in flight is in
    :mod:`mfsdp_ckpt.sharded.in_flight`)."""

    def __init__(self) -> None:
        self.staging = HostStaging()


_state = _AsyncState()


def staging_bytes() -> int:
    """Bytes of this process's staging buffer (what asynchronous saving holds between saves)."""
    return _state.staging.nbytes


def _checkpoint_group() -> dist.ProcessGroup | None:
    """The dedicated gloo group of checkpoint traffic over every rank, created (collectively) at
    the first call after each ``init_process_group``; None outside a process group.

    It is looked up among the live groups rather than kept here: a reference held by this module
    would keep gloo's threads alive past ``destroy_process_group`` (see docs/runtime.md).

    It is created from a short-lived thread of background priority, so that gloo's own threads,
    which carry its bytes (a memory tier's replicas) and start with their creator's priority, yield
    to training as the background thread does."""
    if not dist.is_initialized():
        return None
    for group in list(dist.distributed_c10d._world.pg_names):
        if getattr(group, "group_desc", None) == GROUP_DESC:
            return group
    made: list[dist.ProcessGroup] = []
    failed: list[BaseException] = []

    def create() -> None:
        deprioritise_this_thread()
        try:
            made.append(dist.new_group(backend="gloo", timeout=_default_timeout(), group_desc=GROUP_DESC))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread below
            failed.append(e)

    creator = threading.Thread(target=create, name="mfsdp-ckpt checkpoint group")
    creator.start()
    creator.join()
    if failed:
        raise failed[0]
    return made[0]


def _default_timeout() -> timedelta | None:
    """The default group's timeout (the checkpoint group gives up when training would), or None
    (the backend's default) when it cannot be read."""
    default = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            return default._get_backend(torch.device(device)).options._timeout
    return None


def _decide_on(group: dist.ProcessGroup | None) -> Callable[..., Any]:
    """``rank0_decides`` over ``group`` (None: no process group, a plain call)."""
    if group is None:
        return lambda fn, *args: fn(*args)
    return functools.partial(rank0_decides, group=group)


def _as_checkpoint_error(error: BaseException, path: str) -> CheckpointError:
    """``error`` as a one-line :class:`CheckpointError` (ours are kept as they are)."""
    error.__traceback__, error.__context__, error.__cause__ = None, None, None  # no frames of the write kept alive
    if isinstance(error, CheckpointError) and "\n" not in str(error):
        return error
    text = one_line(error, first_line=True)
    if isinstance(error, CheckpointError):
        with contextlib.suppress(Exception):
            return type(error)(text)
    return CheckpointError(f"{path}: asynchronous save failed: {type(error).__name__}: {text}")


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    include_grads: bool = False,
    model_config: dict[str, Any] | None = None,
    run_config: dict[str, Any] | None = None,
    step: int | None = None,
    keep: int | None = None,
    update_latest: bool = True,
    overwrite: bool = False,
    thread_count: int = 1,
    model_source: dict[str, Any] | None = None,
) -> AsyncSaveHandle:
    """Start saving ``model`` (and ``optimizer``) to ``path`` and return; the copy of the state
    to host memory, the write, the commit, ``latest`` and pruning follow in a background thread.
    Collective: every rank calls it at the same point. Arguments and the checkpoint written are
    those of :func:`mfsdp_ckpt.save`; it holds the state at the call.

    Before returning, on every rank alike: the previous asynchronous save is waited for (its
    error, if no ``result()`` raised it yet, is raised here and this save is not started), then
    ``save``'s refusals raise as ``save`` raises them. Until the background copy is done, the runtime's writes of the
    state (the optimizer step first) wait for it (:mod:`mfsdp_core.fence`); your own writes of
    the model's or optimizer's tensors must call ``handle.wait_staged()`` first. Call
    ``result()`` on the last handle before the process group goes.

    Args:
        path, model, optimizer, extra, include_grads, model_config, run_config, step, keep,
        update_latest, overwrite, thread_count, model_source, each as for :func:`mfsdp_ckpt.save`.

    Returns:
        The save's handle (``result()`` waits for the commit and raises its one-line error).
    """
    started = time.perf_counter()
    check_save_arguments(path, keep)
    group = _checkpoint_group()
    _wait_for_previous(path)
    waited = time.perf_counter() - started
    lock = contextlib.ExitStack()  # rank 0: the run directory's lock, released after the commit
    try:
        job = prepare_save(
            path,
            model,
            optimizer,
            extra=extra,
            include_grads=include_grads,
            model_config=model_config,
            step=step,
            keep=keep,
            update_latest=update_latest,
            overwrite=overwrite,
            thread_count=thread_count,
            lock=lock,
            run_config=run_config,
            model_source=model_source,
        )
        staged = agreed(lambda: _stage(job.entries, job.final))
        fence = Fence(buffers_of(model), grads=include_grads)  # from here the runtime's writes wait for the copy
    except BaseException:
        lock.close()
        raise

    def write(entries: dict[str, Any], planner: MfsdpSavePlanner, on: dist.ProcessGroup | None) -> None:
        job.writer.bound_writes(WRITE_CHUNK_BYTES)
        write_save(job, entries, planner, process_group=on, decide=_decide_on(on))

    return _start(job.final, staged, fence, lock, group, write, started, waited)


def async_write(
    final: str,
    entries: dict[str, Any],
    model: nn.Module,
    write: BackgroundWrite,
) -> AsyncSaveHandle:
    """The engine of :func:`async_save` for another kind of checkpoint (the memory tier's
    snapshots): the previous asynchronous save waited for, ``entries`` (``save_contents``')
    staged, the fence set, and ``write(staged entries, planner, group)`` run in the background
    thread on the dedicated process group, as ``async_save`` runs its write. Collective."""
    started = time.perf_counter()
    group = _checkpoint_group()
    _wait_for_previous(final)
    waited = time.perf_counter() - started
    staged = agreed(lambda: _stage(entries, final))
    fence = Fence(buffers_of(model), grads=False)
    return _start(final, staged, fence, contextlib.ExitStack(), group, write, started, waited)


def _start(
    final: str,
    staged: _Staged,
    fence: Fence,
    lock: contextlib.ExitStack,
    group: dist.ProcessGroup | None,
    write: BackgroundWrite,
    started: float,
    waited: float,
) -> AsyncSaveHandle:
    """Start the thread that copies, writes and commits ``final`` and return its handle, now in
    flight; if the thread cannot start, release the fence and the lock (training and the run
    directory must not stay held by a save that never runs)."""
    handle = AsyncSaveHandle(final, started)
    handle._fence = fence
    handle.waited_s = waited
    thread = threading.Thread(
        target=_write_in_background,
        args=(final, staged, _StagedSavePlanner(staged.properties), fence, handle, lock, group, write),
        name=f"mfsdp-ckpt async save {final}",
    )
    try:
        thread.start()
    except BaseException:
        fence.release()
        lock.close()
        raise
    handle.call_s = time.perf_counter() - started
    set_in_flight(handle)
    return handle


def _wait_for_previous(path: str | os.PathLike) -> None:
    """Wait for the save in flight and clear it, so that saves commit in call order; raise its
    error if nothing has reported it yet (a failure must not go unnoticed because the next save
    was started without looking at the previous handle)."""
    previous = in_flight()
    if previous is None:
        return
    previous.wait()
    set_in_flight(None)
    if previous._error is not None and not previous._reported:
        previous._reported = True
        raise CheckpointError(
            f"the previous asynchronous save ({previous.path}) failed: {previous._error}; "
            f"{os.path.abspath(os.fspath(path))} was not started (call async_save again)"
        )


def _write_in_background(
    final: str,
    staged: _Staged,
    planner: _StagedSavePlanner,
    fence: Fence,
    handle: AsyncSaveHandle,
    lock: contextlib.ExitStack,
    group: dist.ProcessGroup | None,
    write: BackgroundWrite,
) -> None:
    """The background thread's work: fill the staging buffer (then release the fence), write and
    commit, unlock the run directory, and finish ``handle`` with the save's one-line error (or
    None) whatever happens, so that ``result()`` never waits forever."""
    deprioritise_this_thread()  # this thread and those it starts yield to training (module docstring)
    error = None
    try:
        try:
            _fill(staged, planner, final)
        finally:
            fence.release()
            handle._mark_staged()
        try:
            write(staged.entries, planner, group)
        except BaseException as e:  # noqa: BLE001 - reported by the handle
            error = _as_checkpoint_error(e, final)
            with contextlib.suppress(Exception):  # the save's error is the one reported
                lock.close()  # rank 0: the run directory is unlocked before any rank reports
            if group is not None:  # every rank failed alike; none reports before rank 0 removed the partial
                with contextlib.suppress(Exception):
                    dist.barrier(group=group)
        finally:
            lock.close()
    except BaseException as e:  # noqa: BLE001 - releasing the lock failed
        error = error or _as_checkpoint_error(e, final)
    finally:
        handle._finish(error)  # whatever happened: result() never waits forever


def _fill(staged: _Staged, planner: _StagedSavePlanner, final: str) -> None:
    """The background copy into the staging buffer. A failure is not raised here: the planner
    raises it while DCP plans, so that every rank fails the save alike (one rank stopping alone
    would leave the others waiting in DCP's collectives)."""
    try:
        _state.staging.fill(staged)
    except BaseException as e:  # noqa: BLE001 - reported through the save
        _state.staging = HostStaging()  # not reused after a failed copy
        text = one_line(e, first_line=True)
        planner.failure = CheckpointError(f"{final}: cannot copy the state to host memory ({type(e).__name__}: {text})")


def _stage(entries: dict[str, Any], final: str) -> _Staged:
    """Stage ``entries`` (the buffer allocated, the small values copied; the flat ranges
    are left to the background); a failure (no memory for the buffer) as a :class:`CheckpointError`,
    which ``agreed`` raises on every rank (none goes on into the background collectives alone)."""
    try:
        return _state.staging.stage(entries)
    except CheckpointError:
        raise
    except (RuntimeError, MemoryError) as e:
        _state.staging = HostStaging()  # a half-built buffer is not reused
        text = one_line(e, first_line=True)
        raise CheckpointError(f"{final}: cannot copy the state to host memory ({type(e).__name__}: {text})") from None
