"""Offline resharding: rewrite a checkpoint for a target layout (world size, strategy, policy),
one data file per target rank holding exactly the chunks that rank will read.

Any checkpoint already loads into any layout; resharding makes that load cheap: each target rank
opens one file and reads it front to back. The target ranges come from the placement plan the
writer recorded in its manifest (every flat buffer's parameters, policy and strategy), laid out
for the target world size by the runtime's own layout function: no model is built, and nothing
is planned from a model's code.

Streaming: a worker holds one target rank's range of one tensor plus one source chunk at a time,
whatever the checkpoint's size. Source chunks are read whole (their crc32c is checked) and, where
they fall inside the range, straight into place.

``to="torchtitan"`` writes torchtitan's layout instead (:mod:`mfsdp_ckpt.format.titan`: bare model
names, ``optimizer.state.<fqn>.<state>``, one ``optimizer.param_groups.<fqn>.<hp>`` per parameter,
the trainer's entries unchanged), each tensor's rows cut as FSDP2 shards them over the target
ranks, so that torchtitan's own ``CheckpointManager.load`` at that world size finds every rank's
rows in one file.

Workers are threads of this process, each writing whole target files (:func:`default_workers`);
each keeps the disk reading the sources of its next jobs while it writes (:class:`_Readahead`),
so reading the source and writing the target overlap, as ``dd``'s do. Under ``torchrun``
(``torch.distributed`` initialised) the processes of the job share the target files out, each
with its own threads, and process 0 commits once all are written
(:mod:`mfsdp_ckpt.write.job`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mfsdp_ckpt.errors import CheckpointError, OutsideCheckpointError, UncommittedCheckpointError, raise_key_problems
from mfsdp_ckpt.format.boxes import box_view, flat_range_to_boxes
from mfsdp_ckpt.format.keys import (
    MAIN_PARAM,
    PARAM_GROUPS,
    fqn_of_model_key,
    group_of,
    is_rng,
    mx_key,
    mx_plane_of,
    param_of,
)
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.format.names import MANIFEST_NAME
from mfsdp_ckpt.format.titan import (
    STEP_KEY,
    TITAN_GROUPS,
    TITAN_LAYOUT,
    is_trainer_entry,
    row_chunks,
    titan_param_group_entries,
    to_titan_key,
)
from mfsdp_ckpt.model.experts import is_expert_buffer, num_experts_of, regroup_experts
from mfsdp_ckpt.progress import progress_adder
from mfsdp_ckpt.read.inputs import checkpoint_inputs
from mfsdp_ckpt.read.locate import is_mcore
from mfsdp_ckpt.read.manifest import recorded_plan
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.stock import KeyRule, parse_key_map, uncommitted_reason
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.overlap import check_apart
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import ChunkFileWriter, ChunkRecord
from mfsdp_ckpt.write.job import write_checkpoint
from mfsdp_ckpt.write.threads import start_all
from mfsdp_core.dtypes import CAST_CHOICES, dtype_by_name
from mfsdp_core.expert_parallel import EDP_GROUP, EP_GROUP, local_experts
from mfsdp_core.layout import Layout, parse_policy
from mfsdp_core.plan import (
    DEFAULT_GROUP,
    BufferSpec,
    ModelPlan,
    Placement,
    check_companions,
)
from mfsdp_core.strategy import parse_strategy

__all__ = ["reshard", "ReshardResult", "MAX_WORLD_SIZE", "TARGETS", "default_workers"]

MAX_WORLD_SIZE = 1 << 16  # planning is linear in it; a typo of a few zeros must not run for hours
#: the most worker threads ``reshard`` starts by default
MAX_DEFAULT_WORKERS = 4
#: the key layouts ``reshard`` writes (``to=``): ours (canonical keys), torchtitan's
TARGETS = ("mfsdp", TITAN_LAYOUT)


def default_workers(files: int) -> int:
    """The worker threads ``reshard`` uses unless told: one per target file, at most two per CPU
    and :data:`MAX_DEFAULT_WORKERS`. A worker mostly waits for the disk (its reads are fetched
    ahead while it writes), so two per core keep it busy; and with one file each, no worker is
    left with twice the bytes of another (``bench/reshard.py``, 2 CPUs, 4 -> 3 ranks: 3 workers
    took 2.3 s where 2 took 2.9-3.5 s and 1 took 3.1-4.5 s). A larger ``workers=`` is still
    capped at the number of target files (a worker writes whole files)."""
    return max(1, min(files, 2 * (os.cpu_count() or 1), MAX_DEFAULT_WORKERS))


@dataclass(frozen=True)
class ReshardResult:
    path: str
    world_size: int
    files: int  # data files written (one per target shard rank)
    keys: int
    bytes_written: int
    dropped: list[str]  # keys left out (--model-only, RNG states of another world size)
    ep_size: int | None = None  # the target's EP size (None: no expert parallelism)

    def to_json(self) -> dict[str, Any]:
        """The fields under the names of docs/cli.md's JSON vocabulary (``bytes``, ``entries``;
        ``ep_size`` only for an EP target); the command adds ``seconds``."""
        out = dict(self.__dict__)
        out["bytes"] = out.pop("bytes_written")
        out["entries"] = out.pop("keys")
        if out["ep_size"] is None:  # absent, not null, where it does not apply
            del out["ep_size"]
        return out


@dataclass(frozen=True)
class _Job:
    """Write elements ``[start, end)`` of ``key`` into data file ``file``; ``start is None``
    means the whole entry (objects and tensors that belong to no parameter group). ``out``: the
    key written (None: ``key``); :data:`~mfsdp_ckpt.format.titan.TITAN_GROUPS` for
    ``optim.param_groups`` written as torchtitan's per-parameter entries, ``entries`` of them."""

    key: str
    file: int
    start: int | None = None
    end: int | None = None
    cast: torch.dtype | None = None
    nbytes: int = 0
    out: str | None = None
    entries: int = 1


def _stock_plan(reader: MappedReader) -> ModelPlan:
    """A plan for a checkpoint that records none (stock DCP): the floating ``model.*`` tensors,
    in key order, as one ``even`` buffer per dtype over all ranks. It only decides which target
    file holds which range (every rank about 1/N of the bytes, one file each); any layout loads
    the result."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Size]]] = {}
    for key in reader.keys():
        name = fqn_of_model_key(key)
        if name is not None and reader.is_tensor(key) and reader.dtype(key).is_floating_point:
            by_dtype.setdefault(reader.dtype(key), []).append((name, reader.shape(key)))
    buffers = tuple(
        BufferSpec(
            names=tuple(n for n, _ in params),
            shapes=tuple(s for _, s in params),
            dtype=dtype,
            requires_grad=True,
            strategy=parse_strategy("optim_grads_params"),
            placement=Placement("even"),
            group_size=1,
        )
        for dtype, params in by_dtype.items()
    )
    return ModelPlan({DEFAULT_GROUP: 1}, buffers)


def _stock_manifest(reader: MappedReader) -> dict[str, Any]:
    """The manifest fields ``save`` writes, for a source that has no manifest (a torchtitan
    checkpoint's step: its trainer's)."""
    groups = {group_of(k) for k in reader.keys()}
    return {
        "model_config": None,
        "step": _trainer_step(reader),
        "include_grads": "grad" in groups,
        "has_optimizer": "optim" in groups,
        "versions": versions(),
    }


def _trainer_step(reader: MappedReader) -> int | None:
    """torchtitan's ``train_state.step`` (an int), or None where there is none."""
    if not reader.titan or STEP_KEY not in reader.keys():
        return None
    step = reader.read(STEP_KEY)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _source_plan(reader: CheckpointReader | MappedReader, plan_from: str | None) -> ModelPlan:
    """The plan recorded in the checkpoint's manifest, or in ``plan_from``'s (a checkpoint of the
    same model that records one). Checked against the checkpoint's ``model.*`` tensors."""
    source = reader.directory
    plan_source = reader
    if plan_from is not None:
        plan_source = CheckpointReader(plan_from)
        plan_source.close()  # its manifest and metadata are read; no data is
        if plan_source.manifest is None:
            raise UncommittedCheckpointError(f"--plan-from {plan_from}: no mfsdp.json, so no plan")

    tensors = {
        n: md
        for k, md in plan_source.metadata.state_dict_metadata.items()
        if (n := fqn_of_model_key(k)) is not None and isinstance(md, TensorStorageMetadata)
    }

    def shape_of(name: str) -> torch.Size | None:
        return torch.Size(tensors[name].size) if name in tensors else None

    def dtype_of(name: str) -> torch.dtype | None:
        return tensors[name].properties.dtype if name in tensors else None

    where = plan_source.directory
    try:
        plan = recorded_plan(plan_source.manifest, shape_of, dtype_of, f"{where}/{MANIFEST_NAME}")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: the manifest's placement plan is malformed ({type(e).__name__}: {e})"
        ) from None
    if plan is None:
        raise CheckpointError(
            f"{where}: the manifest records no placement plan (written by an older mfsdp-ckpt); "
            "pass --plan-from CKPT naming a checkpoint of the same model that records one, "
            "or load it at the target world size and save it"
        )
    ours = {n: reader.shape(k) for k in reader.keys() if (n := fqn_of_model_key(k)) is not None and reader.is_tensor(k)}
    planned = plan.params()
    missing = sorted(n for n in planned if n not in ours)
    misshapen = sorted(
        f"{n} (plan {tuple(spec.shapes[i])}, checkpoint {tuple(ours[n])})"
        for n, (spec, i) in planned.items()
        if n in ours and tuple(spec.shapes[i]) != tuple(ours[n])
    )
    raise_key_problems(
        f"{source}: the placement plan of {where} does not fit",
        [("parameters with no 'model.' tensor", missing), ("shape mismatch", misshapen)],
    )
    return plan


def _target_plan(
    plan: ModelPlan,
    world_size: int,
    strategy: str | None,
    policy: str | None,
    cast: torch.dtype | None,
    ep: int | None = None,
    source_ep: int | None = None,
) -> tuple[ModelPlan, dict[str, tuple[Layout, int, tuple[int, ...]]], dict[str, Any] | None]:
    """The source plan laid out for ``world_size`` ranks (and the strategy / policy asked), every
    parameter's target layout, index there and the global rank of each of its shard ranks, and
    the target's ``writer.experts`` (None without expert parallelism).

    A plan with expert parallelism (expert buffers over ``edp``), or any plan with experts when
    ``ep`` > 1, is laid out as the runtime at (``world_size``, ``ep``) builds it
    (:func:`~mfsdp_ckpt.model.experts.regroup_experts`); ``ep`` defaults to ``source_ep``, the writer's
    EP size. An HSDP / HFSDP buffer (sharded over a shard group, replicated across another) is
    laid out flat over ``dp``, as its checkpoint does not depend on the mesh. Any other group than
    ``dp`` and the experts' ``edp`` is refused."""
    plan = ModelPlan(plan.group_sizes, tuple(spec.unreplicated() for spec in plan.buffers))
    others = sorted(
        g
        for g in {spec.placement.group for spec in plan.buffers}
        if g != DEFAULT_GROUP and not all(is_expert_buffer(s) for s in plan.buffers if s.placement.group == g)
    )
    if others:
        raise CheckpointError(
            f"reshard: the plan places buffers over group(s) {', '.join(others)} besides "
            f"'{DEFAULT_GROUP}'; resharding such plans needs their target sizes, which reshard does not take yet"
        )
    strat = parse_strategy(strategy) if strategy else None
    pol = parse_policy(policy) if policy else None
    expert_parallel = any(is_expert_buffer(s) for s in plan.buffers)
    target_ep = ep if ep is not None else (source_ep or 1) if expert_parallel else 1
    if expert_parallel or target_ep != 1:
        num = _check_ep(plan, world_size, target_ep, given=ep is not None)
    if expert_parallel or target_ep > 1:
        placed = regroup_experts(plan, world_size, target_ep, strategy=strat, policy=pol)
        sizes = {DEFAULT_GROUP: world_size, EP_GROUP: target_ep, EDP_GROUP: world_size // target_ep}
        experts = {"ep_size": target_ep, "owners": [list(local_experts(num, target_ep, p)) for p in range(target_ep)]}
    else:
        placed = [
            (spec.resized(world_size, strategy=strat, policy=pol), tuple(range(world_size))) for spec in plan.buffers
        ]
        sizes, experts = {DEFAULT_GROUP: world_size}, None
    buffers, where = [], {}
    for target, ranks in placed:
        if cast is not None and target.dtype.is_floating_point:
            target = dataclasses.replace(target, dtype=cast, param_dtype=cast)
        try:
            layout = target.layout
        except ValueError as e:
            raise CheckpointError(f"--policy: {e}") from None
        for i, name in enumerate(target.fqns):
            where[name] = (layout, i, ranks)
            if target.placement.mx is not None:
                try:
                    check_companions(name, target.shapes[i], target.placement)
                except ValueError as e:
                    raise CheckpointError(f"--policy {policy}: {e}") from None
                for plane, plane_layout in target.companion_layouts.items():  # MX planes: cut on the same blocks
                    where[mx_key(name, plane)] = (plane_layout, i, ranks)
        buffers.append(target)
    return ModelPlan(sizes, tuple(buffers)), where, experts


def _check_ep(plan: ModelPlan, world_size: int, ep: int, given: bool) -> int:
    """The number of experts, after refusing an EP size that cannot place them over
    ``world_size`` ranks (one line naming the numbers)."""
    flag = f"--ep {ep}" if given else f"the source's EP size {ep} (pass --ep)"
    if ep < 1:
        raise CheckpointError(f"--ep must be >= 1, got {ep}")
    if world_size % ep:
        raise CheckpointError(f"{flag} does not divide --world-size {world_size}")
    num = num_experts_of(s for s in plan.buffers if s.is_expert)
    if num == 0:
        raise CheckpointError(f"{flag}: the checkpoint has no experts (expert parallelism needs them)")
    if ep > num:
        raise CheckpointError(f"{flag} exceeds the number of experts in the checkpoint, {num}")
    if num % ep:
        raise CheckpointError(f"{flag} does not divide the number of experts in the checkpoint, {num}")
    return num


def _plan_jobs(
    reader: MappedReader,
    params: dict[str, tuple[Layout, int, tuple[int, ...]]],
    *,
    model_only: bool,
    cast: torch.dtype | None,
    keep_rng: bool,
) -> tuple[list[_Job], list[str]]:
    """Every write: each parameter-shaped tensor cut by its target layout, shard rank r's piece
    into the file of the global rank holding it; everything else whole into file 0."""
    jobs, dropped = [], []
    for key in reader.keys():
        if model_only and (group_of(key) in ("optim", "grad") or is_trainer_entry(key)):
            dropped.append(key)
            continue
        if is_rng(key) and not keep_rng:
            dropped.append(key)
            continue
        if not reader.is_tensor(key):
            jobs.append(_Job(key, 0))
            continue
        key_cast = (
            cast if cast is not None and group_of(key) == "model" and reader.dtype(key).is_floating_point else None
        )
        itemsize = (key_cast or reader.dtype(key)).itemsize
        name = param_of(key, params)
        placed = params[name] if name is not None else params.get(key) if mx_plane_of(key) else None
        layout, index, ranks = placed if placed is not None else (None, 0, ())
        if layout is None or reader.shape(key) != torch.Size(layout.shapes[index]):  # e.g. Adam's scalar step
            jobs.append(_Job(key, 0, cast=key_cast, nbytes=reader.shape(key).numel() * itemsize))
            continue
        for r in range(layout.group_size):
            piece = layout.piece(index, r)
            if piece.numel:
                jobs.append(_Job(key, ranks[r], piece.start, piece.end, key_cast, piece.numel * itemsize))
    return jobs, dropped


def _plan_titan_jobs(
    reader: MappedReader, world_size: int, *, model_only: bool, cast: torch.dtype | None
) -> tuple[list[_Job], list[str]]:
    """Every write of a torchtitan-layout target (:func:`~mfsdp_ckpt.format.titan.to_titan_key`):
    each tensor's rows as FSDP2 shards them over ``world_size`` ranks, rank r's into file r
    (:func:`~mfsdp_ckpt.format.titan.row_chunks`); scalars, objects and the per-parameter
    hyper-parameters whole into file 0. ``model_only`` drops the optimizer's and the trainer's
    state; ``cast`` applies to the floating model weights (the fp32 main params standing in for
    a low-precision model's among them)."""
    keys = reader.keys()
    mains = {to_titan_key(k) for k in keys if k.startswith("optim.") and k.endswith(f".{MAIN_PARAM}")}
    jobs, dropped = [], []
    for key in keys:
        out = TITAN_GROUPS if key == PARAM_GROUPS else to_titan_key(key)
        weights = group_of(key) == "model" or (group_of(key) == "optim" and out in mains)
        training = group_of(key) in ("optim", "grad") or is_trainer_entry(key)
        if out is None or fqn_of_model_key(key) in mains or (model_only and training and not weights):
            dropped.append(key)  # nowhere in torchtitan's layout, stood in for, or training state
            continue
        if out == TITAN_GROUPS:  # read now: its entries counted, a malformed one refused before writing
            jobs.append(
                _Job(key, 0, out=out, entries=len(titan_param_group_entries(reader.read(key), reader.directory)))
            )
            continue
        if not reader.is_tensor(key):
            jobs.append(_Job(key, 0, out=out))
            continue
        key_cast = cast if cast is not None and weights and reader.dtype(key).is_floating_point else None
        shape, itemsize = reader.shape(key), (key_cast or reader.dtype(key)).itemsize
        if shape.numel() == 0 or len(shape) == 0:
            jobs.append(_Job(key, 0, cast=key_cast, nbytes=shape.numel() * itemsize, out=out))
            continue
        row = shape.numel() // shape[0]
        for r, (lo, hi) in enumerate(row_chunks(shape[0], world_size)):
            if hi > lo:
                jobs.append(_Job(key, r, lo * row, hi * row, key_cast, (hi - lo) * row * itemsize, out))
    return jobs, dropped


#: how far ahead of the job being written a worker asks the kernel to read its sources
READAHEAD_BYTES = 128 << 20


class _Cancelled(Exception):
    """A worker stopped because another one failed or the run was interrupted (never reported)."""


def _source_ranges(reader: MappedReader, job: _Job) -> list[tuple[str, int, int]]:
    """``(data file, offset, length)`` of the stored chunks ``job`` reads (those whose flat
    extent meets its range): what :class:`_Readahead` asks the kernel to fetch (a hint: an entry
    it cannot place gives no ranges)."""
    try:
        raw_key = reader.source_key(job.key)
        chunks = reader.raw.stored_chunks(raw_key)
        md = reader.raw.metadata.state_dict_metadata[raw_key]
    except (CheckpointError, KeyError):
        return []
    if job.start is not None and isinstance(md, TensorStorageMetadata):
        shape = tuple(md.size)
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        kept = []
        for index, info in chunks:
            offsets, box = tuple(index.offset or ()), sizes.get(tuple(index.offset or ()))
            if box is None or 0 in box:
                continue
            first = sum(o * s for o, s in zip(offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(offsets, box, strides))
            if first < job.end and last >= job.start:
                kept.append((index, info))
        chunks = kept
    return [(info.relative_path, info.offset, info.length) for _, info in chunks]


def _advise(directory: str, name: str, offset: int, length: int) -> None:
    """``posix_fadvise(WILLNEED)`` of a byte range of the data file ``name``: the kernel starts
    reading it into the page cache and returns. The file is opened as the reader opens it
    (:func:`~mfsdp_ckpt.storage.fs.open_member`: a regular file inside the checkpoint, never a
    name or symlink leading out); any failure is ignored (a hint; the read reports it)."""
    try:
        f = fs.open_member(directory, name)
    except (OSError, OutsideCheckpointError):
        return
    with f:
        try:
            os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        except (OSError, ValueError):
            pass


class _Readahead:
    """Keeps the disk reading a worker's next sources while it writes: a thread asks the kernel
    (:func:`_advise`) for the chunks of the jobs after the current one, up to
    :data:`READAHEAD_BYTES` ahead, so that reads of the source overlap the writes of the target
    instead of alternating with them (the reads themselves, and their crc32c checks, are as
    before: from the page cache). Nothing for a remote source, or where the call is missing."""

    def __init__(self, reader: MappedReader, jobs: Sequence[_Job]) -> None:
        self._thread = None
        if not hasattr(os, "posix_fadvise") or not fs.is_local(reader.directory):
            return
        self._directory = reader.directory
        self._ranges = [_source_ranges(reader, job) for job in jobs]
        self._ends = list(itertools.accumulate(sum(r[2] for r in rs) for rs in self._ranges))
        self._current, self._closed = 0, False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="reshard-readahead", daemon=True)
        self._thread.start()

    def at(self, i: int) -> None:
        """The worker starts job ``i``."""
        if self._thread is not None:
            with self._cond:
                self._current = i
                self._cond.notify()

    def close(self) -> None:
        if self._thread is not None:
            with self._cond:
                self._closed = True
                self._cond.notify()
            self._thread.join()

    def _run(self) -> None:
        nxt = 0  # the next job to advise
        while True:
            with self._cond:
                while not self._closed and (
                    nxt >= len(self._ranges)
                    or (nxt > self._current and self._ends[nxt - 1] - self._ends[self._current] >= READAHEAD_BYTES)
                ):
                    self._cond.wait()
                if self._closed:
                    return
                nxt = max(nxt, self._current)
            for name, offset, length in self._ranges[nxt]:
                _advise(self._directory, name, offset, length)
            nxt += 1


def _run_jobs(
    src: str,
    tmp: str,
    jobs: Sequence[_Job],
    report: Callable[[int], None],
    key_map: Sequence[KeyRule] = (),
    stop: threading.Event | None = None,
) -> list[ChunkRecord]:
    """Carry out ``jobs`` (all of them for a set of files that no other worker writes); keys are
    canonical, read through ``key_map`` and the source's key layout (:class:`MappedReader`).
    ``stop``: set by the caller to end the run before the next job (:class:`_Cancelled`)."""
    records: list[ChunkRecord] = []
    writer = ChunkFileWriter(tmp)
    scratch = _Scratch()
    try:
        with MappedReader(src, key_map) as reader:
            readahead = _Readahead(reader, jobs)
            try:
                for i, (job, after) in enumerate(zip(jobs, [*jobs[1:], None])):
                    if stop is not None and stop.is_set():
                        raise _Cancelled()
                    readahead.at(i)
                    records += _run_job(reader, writer, job, scratch)
                    report(job.nbytes)
                    if after is None or after.file != job.file:
                        writer.close_file(job.file)  # done with it: open files stay few, whatever the world size
            finally:
                readahead.close()
    except BaseException:
        writer.discard()  # the caller removes the partial directory
        raise
    writer.close()
    return records


class _Scratch:
    """One worker's buffer for the flat ranges it reads, grown to the largest and reused: a
    fresh tensor per job leaves the allocator holding freed ranges it does not give back."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements of ``dtype``, valid until the next take."""
        nbytes = numel * dtype.itemsize
        if self._bytes.numel() < nbytes:
            self._bytes = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self._bytes[:nbytes].view(dtype)


def _run_job(reader: MappedReader, writer: ChunkFileWriter, job: _Job, scratch: _Scratch) -> list[ChunkRecord]:
    """One job: read (every chunk crc32c-checked) into ``scratch`` and append the result to its
    file (written before the next job reads)."""
    out = job.out or job.key
    if job.start is None:
        value = reader.read(job.key)
        if out == TITAN_GROUPS:
            entries = titan_param_group_entries(value, reader.directory)
            return [writer.write_object(k, v, job.file) for k, v in entries.items()]
        if not isinstance(value, torch.Tensor):
            return [writer.write_object(out, value, job.file)]
        if job.cast is not None:
            value = value.to(job.cast)
        return [writer.write_chunk(out, value, (0,) * value.dim(), value.shape, job.file)]
    flat = reader.read_flat(job.key, job.start, job.end, out=scratch.take(job.end - job.start, reader.dtype(job.key)))
    if job.cast is not None:
        flat = flat.to(job.cast)
    shape = reader.shape(job.key)
    return [
        writer.write_chunk(out, box_view(flat, job.start, box), box.offsets, shape, job.file)
        for box in flat_range_to_boxes(shape, job.start, job.end)
    ]


def _assign(jobs: list[_Job], workers: int) -> list[list[_Job]]:
    """Whole files to workers, largest first onto the least-loaded worker."""
    per_file: dict[int, list[_Job]] = {}
    for job in jobs:
        per_file.setdefault(job.file, []).append(job)
    workers = max(min(workers, len(per_file)), 1)  # no more workers than files
    loads = [0] * workers
    out: list[list[_Job]] = [[] for _ in range(workers)]
    for file in sorted(per_file, key=lambda f: -sum(j.nbytes for j in per_file[f])):
        w = loads.index(min(loads))
        out[w].extend(per_file[file])
        loads[w] += sum(j.nbytes for j in per_file[file])
    return [w for w in out if w]


def _run_parallel(
    src: str, tmp: str, assignments: list[list[_Job]], report: Callable[[int], None], key_map: Sequence[KeyRule] = ()
) -> list[ChunkRecord]:
    """Carry out each worker's jobs on a thread of its own; their records, in no order.

    Threads suffice: what a job spends its time on (reads, crc32c, copies, writes, fsync) runs
    with the GIL released, and a thread costs nothing to start, where a process had to import
    torch again. Progress is reported from this thread. The first failure (or a Ctrl-C here)
    stops the others before their next job; once all have stopped it is raised, as it was raised
    in the worker."""
    events: queue.Queue[tuple[str, Any]] = queue.Queue()
    stop = threading.Event()

    def work(jobs: list[_Job]) -> None:
        try:
            events.put(("done", _run_jobs(src, tmp, jobs, lambda n: events.put(("progress", n)), key_map, stop)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            events.put(("error", e))

    threads = [
        threading.Thread(target=work, args=(jobs,), name=f"reshard-worker-{w}", daemon=True)
        for w, jobs in enumerate(assignments)
    ]
    records: list[ChunkRecord] = []
    failure: BaseException | None = None
    try:
        start_all(threads)  # a Ctrl-C meanwhile waits until every worker can be joined
        pending = len(threads)
        while pending:
            kind, payload = events.get()
            if kind == "progress":
                if failure is None:
                    report(payload)
                continue
            pending -= 1
            if kind == "done":
                records.extend(payload)
            elif failure is None or isinstance(failure, _Cancelled):
                failure = payload
                stop.set()
    finally:
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join()
    if failure is not None:
        raise failure
    return records


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    world_size: int,
    ep: int | None = None,
    strategy: str | None = None,
    policy: str | None = None,
    plan_from: str | os.PathLike | None = None,
    model_only: bool = False,
    dtype: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    key_map: Sequence[str | KeyRule] = (),
    progress: Callable[[int, int], None] | None = None,
    to: str = "mfsdp",
) -> ReshardResult:
    """Rewrite the committed checkpoint ``src`` as ``dst`` for ``world_size`` ranks with
    ``strategy`` / ``policy`` (default: the writer's, per parameter group) and EP size ``ep``
    (default: the writer's; 1 without expert parallelism): under expert parallelism, EP rank p'
    holds experts ``p'·N/ep … (p'+1)·N/ep - 1``, sharded over its ``world_size / ep`` ranks, and
    the piece of its k-th of them goes to the file of global rank ``k·ep + p'``.

    ``src`` may be a stock DCP checkpoint (no ``mfsdp.json``; :mod:`mfsdp_ckpt.read.stock` maps its
    keys, ``key_map``'s ``OLD=NEW`` prefix renames first, e.g. ``'=model.'`` for bare FQNs); its
    plan is ``plan_from``'s or one ``even`` buffer of its ``model.*`` tensors. ``model_only``
    drops optimizer, gradient and torchtitan's trainer state; ``dtype`` casts the ``model.*`` weights;
    RNG states stay only at the same world size. ``to``: ``"mfsdp"`` or ``"torchtitan"`` (:func:`_plan_titan_jobs`). ``workers`` threads write disjoint
    target files (default: :func:`default_workers`). ``progress(done, total)`` gets bytes.
    ``dst`` appears only when complete (replacing one only with ``overwrite``).

    Collective when ``torch.distributed`` is initialised (``torchrun -m mfsdp_cli.main reshard``):
    the processes share the target files out (by bytes, :meth:`~mfsdp_ckpt.write.agreement.Job.owners`),
    each reading only the source ranges of its own, and process 0 commits once every one is
    written (:mod:`mfsdp_ckpt.write.job`); the files are the same bytes for any number of
    processes, ``workers`` threads on each.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if plan_from is not None:  # read as well: never written over, into or around
        check_apart(dst, {"the --plan-from checkpoint": checkpoint_inputs(plan_from)})
    job = Job.current()
    what = f"{dst}: not written"
    rules, planned = job.run(
        what,
        _checked_plan,
        src,
        dict(
            world_size=world_size,
            ep=ep,
            workers=workers,
            strategy=strategy,
            policy=policy,
            plan_from=plan_from,
            model_only=model_only,
            dtype=dtype,
            key_map=key_map,
            to=to,
        ),
    )
    jobs = planned.jobs
    files = max([j.file for j in jobs], default=0) + 1
    my_jobs, mine = _my_jobs(job, jobs, files)
    if workers is None:
        workers = default_workers(mine)
    out_manifest = _output_manifest(planned, world_size, model_only=model_only, dtype=dtype, rules=rules)
    report = progress_adder(progress, sum(j.nbytes for j in my_jobs))
    path, written = _write_target(
        job,
        dst,
        out_manifest,
        planned.src_dir,
        my_jobs,
        workers=workers,
        overwrite=overwrite,
        report=report,
        rules=rules,
    )
    ep_size = planned.experts["ep_size"] if planned.experts else None
    keys = sum({j.key: j.entries for j in jobs}.values())
    return ReshardResult(path, world_size, files, keys, written, planned.dropped, ep_size)


def _my_jobs(job: Job, jobs: list[_Job], files: int) -> tuple[list[_Job], int]:
    """This process's jobs (those of the target files it writes: whole files, shared out by
    bytes, :meth:`~mfsdp_ckpt.write.agreement.Job.owners`) and how many files it writes."""
    sizes = [0] * files
    for j in jobs:
        sizes[j.file] += j.nbytes
    mine = set(job.mine(sizes))
    return [j for j in jobs if j.file in mine], len(mine)


def _checked_plan(src: str, args: dict[str, Any]) -> tuple[list[KeyRule], _Planned]:
    """The arguments checked (one line naming the flag) and the whole reshard planned from the
    source's metadata: the key rules and :class:`_Planned` (the same on every process of a job)."""
    cast = _check_arguments(args["world_size"], args["workers"], args["strategy"], args["policy"], args["dtype"])
    _check_target(args)
    rules = parse_key_map(args["key_map"])
    _refuse_mcore(src, args["world_size"], rules)
    planned = _plan_reshard(
        src,
        rules,
        world_size=args["world_size"],
        ep=args["ep"],
        strategy=args["strategy"],
        policy=args["policy"],
        plan_from=args["plan_from"],
        model_only=args["model_only"],
        cast=cast,
        to=args["to"],
    )
    return rules, planned


def _check_target(args: dict[str, Any]) -> None:
    """Refuse an unknown ``--to``, and what a torchtitan target has no use for (its layout is
    FSDP2's, fixed by the world size), in one line naming the flag."""
    if args["to"] not in TARGETS:
        raise CheckpointError(f"--to {args['to']!r}: expected one of {', '.join(TARGETS)}")
    if args["to"] != TITAN_LAYOUT:
        return
    for flag, value in (
        ("--strategy", "strategy"),
        ("--policy", "policy"),
        ("--ep", "ep"),
        ("--plan-from", "plan_from"),
    ):
        if args[value] is not None:
            raise CheckpointError(
                f"{flag}: does not apply to --to {TITAN_LAYOUT} (FSDP2's layout: every tensor's rows over the ranks)"
            )


def _check_arguments(
    world_size: int, workers: int | None, strategy: str | None, policy: str | None, dtype: str | None
) -> torch.dtype | None:
    """Refuse bad arguments before anything is read (one line naming the flag); returns the
    dtype ``dtype`` names (None: no cast)."""
    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise CheckpointError(f"--world-size must be <= {MAX_WORLD_SIZE}, got {world_size}")
    if workers is not None and (type(workers) is not int or workers < 1):
        raise CheckpointError(f"--workers must be >= 1, got {workers}")
    if strategy is not None:
        try:
            parse_strategy(strategy)
        except ValueError as e:
            raise CheckpointError(f"--strategy: {e}") from None
    if policy is not None:
        try:
            parse_policy(policy)
        except ValueError as e:
            raise CheckpointError(f"--policy: {e}") from None
    if dtype is None:
        return None
    if dtype not in CAST_CHOICES:
        raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(CAST_CHOICES)}")
    return dtype_by_name(dtype)


def _refuse_mcore(src: str, world_size: int, rules: Sequence[KeyRule]) -> None:
    """Refuse a Megatron-Core checkpoint read without a key map: its stacked layers' keys are not
    canonical ones, and import-mcore is the command that lays it out."""
    if not rules and is_mcore(src):
        raise CheckpointError(
            f"{src}: a Megatron-Core checkpoint; 'mfsdp-ckpt import-mcore {src} DST --world-size "
            f"{world_size}' lays it out for {world_size} ranks"
        )


@dataclass(frozen=True)
class _Planned:
    """What reading the source decided: its directory and manifest (a stock checkpoint's made up
    by :func:`_stock_manifest`), the writer's world and EP sizes, the target plan and
    ``writer.experts``, and the writes (with the keys left out)."""

    src_dir: str
    manifest: dict[str, Any]
    stock: bool
    titan: bool  # the source is in torchtitan's layout
    target: str  # "mfsdp" or "torchtitan" (TARGETS)
    source_world: int | None
    source_ep: int | None
    plan: ModelPlan
    experts: dict[str, Any] | None
    jobs: list[_Job]
    dropped: list[str]


def _plan_reshard(
    src: str,
    rules: Sequence[KeyRule],
    *,
    world_size: int,
    ep: int | None,
    strategy: str | None,
    policy: str | None,
    plan_from: str | os.PathLike | None,
    model_only: bool,
    cast: torch.dtype | None,
    to: str = "mfsdp",
) -> _Planned:
    """Open the source once and plan everything from its manifest and metadata: the source plan
    (recorded, ``plan_from``'s, or a stock checkpoint's), its target layout, and every write (a
    torchtitan target: :func:`_plan_titan_jobs`)."""
    with MappedReader(src, rules) as reader:
        _refuse_uncommitted(reader)
        stock = reader.manifest is None
        manifest = reader.manifest if not stock else _stock_manifest(reader)
        source_ep = ((manifest.get("writer") or {}).get("experts") or {}).get("ep_size")
        source_world = manifest.get("writer", {}).get("world_size")
        if to == TITAN_LAYOUT:
            plan, experts = ModelPlan({DEFAULT_GROUP: world_size}, ()), None
            jobs, dropped = _plan_titan_jobs(reader, world_size, model_only=model_only, cast=cast)
        else:
            if (stock or manifest.get("key_layout") == TITAN_LAYOUT) and plan_from is None:
                source_plan = _stock_plan(reader)  # names alone: a stock source, or ours in torchtitan's layout
            else:
                source_plan = _source_plan(reader, None if plan_from is None else os.fspath(plan_from))
            plan, params, experts = _target_plan(
                source_plan, world_size, strategy, policy, cast, ep, source_ep or source_plan.group_sizes.get(EP_GROUP)
            )
            jobs, dropped = _plan_jobs(
                reader, params, model_only=model_only, cast=cast, keep_rng=source_world == world_size
            )
        src_dir, titan = reader.directory, reader.titan
    return _Planned(src_dir, manifest, stock, titan, to, source_world, source_ep, plan, experts, jobs, dropped)


def _refuse_uncommitted(reader: MappedReader) -> None:
    """Refuse a checkpoint without a manifest that shows signs of mfsdp's writer: a save that
    never committed (or a deleted manifest) is not a stock DCP checkpoint."""
    mark = uncommitted_reason(reader.directory, reader.metadata) if reader.manifest is None else None
    if mark is not None:
        raise UncommittedCheckpointError(
            f"{reader.directory}: no mfsdp.json, but {mark}: a save that never committed, or a deleted manifest"
        )


def _output_manifest(
    planned: _Planned, world_size: int, *, model_only: bool, dtype: str | None, rules: Sequence[KeyRule]
) -> dict[str, Any]:
    """The target's manifest: the source's, less what the new write records anew, with the
    target's writer layout and where it was resharded from."""
    manifest = planned.manifest
    out_manifest = {
        k: v
        for k, v in manifest.items()
        if k not in ("chunks", "save_id", "created_unix", "total_bytes", "format", "format_version")
    }
    out_manifest["writer"] = writer_layout(world_size, planned.plan, planned.experts)
    if model_only:
        out_manifest.update(has_optimizer=False, include_grads=False)
    if planned.target == TITAN_LAYOUT:
        out_manifest.update(key_layout=TITAN_LAYOUT, include_grads=False)
    else:
        out_manifest.pop("key_layout", None)  # canonical keys now, whatever the source's layout
    out_manifest["resharded_from"] = {
        "path": planned.src_dir,
        "save_id": manifest.get("save_id"),
        "world_size": planned.source_world,
        "ep_size": planned.source_ep,
        "model_only": model_only,
        "dtype": dtype,
        "format": TITAN_LAYOUT if planned.titan else "stock DCP" if planned.stock else "mfsdp",
        "key_map": [str(r) for r in rules],
    }
    return out_manifest


def _write_target(
    job: Job,
    dst: str,
    out_manifest: dict[str, Any],
    src_dir: str,
    jobs: list[_Job],
    *,
    workers: int,
    overwrite: bool,
    report: Callable[[int], None],
    rules: Sequence[KeyRule],
) -> tuple[str, int]:
    """Carry out ``jobs`` (this process's: whole target files) into a new checkpoint at ``dst``
    (on this thread, or over ``workers`` threads) and commit it once every process of ``job``
    has written its files (:func:`~mfsdp_ckpt.write.job.write_checkpoint`); returns its path and
    the bytes written by the whole job."""

    def write(tmp: str) -> tuple[list[ChunkRecord], None]:
        assignments = _assign(jobs, workers)
        if len(assignments) <= 1:
            return _run_jobs(src_dir, tmp, assignments[0] if assignments else [], report, rules), None
        return _run_parallel(src_dir, tmp, assignments, report, rules), None

    path, written, _ = write_checkpoint(job, dst, out_manifest, write, overwrite=overwrite, sources=(src_dir,))
    return path, written
