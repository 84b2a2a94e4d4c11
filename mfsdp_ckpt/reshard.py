"""Offline resharding: rewrite a checkpoint for a target layout (world size, strategy, policy),
one data file per target rank holding exactly the chunks that rank will read.

Any checkpoint already loads into any layout (DESIGN §4); resharding makes that load cheap: each
target rank opens one file and reads it front to back. The target ranges come from the same pure
function the runtime uses (:func:`mfsdp_core.compute_layout`), applied to the parameter groups the
writer recorded in its manifest (``writer.groups``; planned from the model config when no sharded
model wrote the checkpoint, see :mod:`mfsdp_ckpt.groups`), so no model has to be built.

Streaming: a worker holds one target rank's range of one tensor plus one source chunk at a time,
whatever the checkpoint's size. Source chunks are read whole (their crc32c is checked) and, where
they fall inside the range, straight into place.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mfsdp_core.dtypes import CAST_CHOICES, dtype_by_name
from mfsdp_core.layout import Layout, compute_layout, parse_policy
from mfsdp_core.strategy import parse_strategy

from .boxes import box_view, flat_range_to_boxes
from .errors import CheckpointError, UncommittedCheckpointError
from .groups import planned_groups
from .manifest import writer_layout
from .streaming import CheckpointBuilder, CheckpointReader, ChunkFileWriter, ChunkRecord

__all__ = ["reshard", "ReshardResult"]

_RNG_PREFIX = "extra.rng.rank"


@dataclass(frozen=True)
class ReshardResult:
    path: str
    world_size: int
    files: int  # data files written (one per target shard rank)
    keys: int
    bytes_written: int
    dropped: list[str]  # keys left out (--model-only, RNG states of another world size)


@dataclass(frozen=True)
class _Job:
    """Write elements ``[start, end)`` of ``key`` into data file ``file``; ``start is None``
    means the whole entry (objects and tensors that belong to no parameter group)."""

    key: str
    file: int
    start: int | None = None
    end: int | None = None
    cast: torch.dtype | None = None
    nbytes: int = 0


def _target_groups(manifest: dict[str, Any], shapes: dict[str, torch.Size], world_size: int,
                   strategy: str | None, policy: str | None, source: str) -> tuple[list[dict[str, Any]], dict[str, tuple[Layout, int]]]:
    """The target's parameter groups (for its manifest) and, for every parameter, its target
    layout and index there."""
    recorded = manifest.get("writer", {}).get("groups")
    groups, origin = recorded, "manifest"
    if not recorded:  # no sharded model wrote it (import-hf), or it predates writer.groups
        groups = planned_groups(manifest.get("model_config"))
        origin = "model_config (buffers planned as mfsdp_core.train makes them)"
    if groups is None:
        if recorded is None:
            raise CheckpointError(f"{source}: the manifest records neither the writer's parameter groups nor a GPT "
                                  "model_config (written by an older mfsdp-ckpt); load it at the target world size and save it instead")
        groups = []  # recorded as none (convert --to dcp): every tensor whole, in file 0
    out_groups, where = [], {}
    for g in groups:
        strat = parse_strategy(strategy or g["strategy"])
        pol = parse_policy(policy or g["policy"])
        names = list(g["params"])
        missing = [n for n in names if n not in shapes]
        if missing:
            raise CheckpointError(f"{source}: the {origin} names parameters with no 'model.' tensor: {', '.join(missing)}")
        shard_ranks = world_size if strat.shards_optim else 1
        try:
            layout = compute_layout([shapes[n] for n in names], shard_ranks, pol, names)
        except ValueError as e:
            raise CheckpointError(f"--policy: {e}") from None
        for i, n in enumerate(names):
            where[n] = (layout, i)
        out_groups.append({"params": names, "strategy": strat.value, "policy": str(pol),
                           "group_size": shard_ranks, "is_expert": g.get("is_expert", False)})
    return out_groups, where


def _param_of(key: str, params: dict[str, tuple[Layout, int]]) -> str | None:
    """The parameter a per-element key belongs to: ``model.<p>``, ``grad.<p>``, ``optim.<p>.<state>``."""
    if key.startswith(("model.", "grad.")):
        name = key.split(".", 1)[1]
        return name if name in params else None
    if key.startswith("optim."):
        name = key[len("optim.") :].rsplit(".", 1)[0]
        return name if name in params else None
    return None


def _plan_jobs(reader: CheckpointReader, params: dict[str, tuple[Layout, int]], *, model_only: bool,
               cast: torch.dtype | None, keep_rng: bool) -> tuple[list[_Job], list[str]]:
    jobs, dropped = [], []
    for key in reader.keys():
        if model_only and key.startswith(("optim.", "grad.")):
            dropped.append(key)
            continue
        if key.startswith(_RNG_PREFIX) and not keep_rng:
            dropped.append(key)
            continue
        if not reader.is_tensor(key):
            jobs.append(_Job(key, 0))
            continue
        key_cast = cast if cast is not None and key.startswith("model.") and reader.dtype(key).is_floating_point else None
        itemsize = (key_cast or reader.dtype(key)).itemsize
        name = _param_of(key, params)
        layout, index = params[name] if name is not None else (None, 0)
        if layout is None or reader.shape(key) != torch.Size(layout.shapes[index]):  # e.g. Adam's scalar step
            jobs.append(_Job(key, 0, cast=key_cast, nbytes=reader.shape(key).numel() * itemsize))
            continue
        for r in range(layout.group_size):
            piece = layout.piece(index, r)
            if piece.numel:
                jobs.append(_Job(key, r, piece.start, piece.end, key_cast, piece.numel * itemsize))
    return jobs, dropped


def _run_jobs(src: str, tmp: str, jobs: Sequence[_Job], report: Callable[[int], None]) -> list[ChunkRecord]:
    """Carry out ``jobs`` (all of them for a set of files that no other worker writes)."""
    records: list[ChunkRecord] = []
    writer = ChunkFileWriter(tmp)
    try:
        with CheckpointReader(src) as reader:
            for job in jobs:
                if job.start is None:
                    value = reader.read(job.key)
                    if isinstance(value, torch.Tensor):
                        if job.cast is not None:
                            value = value.to(job.cast)
                        records.append(writer.write_chunk(job.key, value, (0,) * value.dim(), value.shape, job.file))
                    else:
                        records.append(writer.write_object(job.key, value, job.file))
                else:
                    flat = reader.read_flat(job.key, job.start, job.end)
                    if job.cast is not None:
                        flat = flat.to(job.cast)
                    shape = reader.shape(job.key)
                    for box in flat_range_to_boxes(shape, job.start, job.end):
                        records.append(writer.write_chunk(job.key, box_view(flat, job.start, box), box.offsets, shape, job.file))
                    del flat
                report(job.nbytes)
    finally:
        writer.close()
    return records


def _worker(src: str, tmp: str, jobs: list[_Job], wid: int, results: Any) -> None:
    try:
        records = _run_jobs(src, tmp, jobs, lambda n: results.put(("progress", wid, n)))
        results.put(("done", wid, records))
    except CheckpointError as e:
        results.put(("error", wid, str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        traceback.print_exc()  # the details, on the worker's stderr; the parent raises one line
        results.put(("error", wid, f"reshard worker {wid}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def _assign(jobs: list[_Job], workers: int) -> list[list[_Job]]:
    """Whole files to workers, largest first onto the least-loaded worker."""
    per_file: dict[int, list[_Job]] = {}
    for job in jobs:
        per_file.setdefault(job.file, []).append(job)
    loads = [0] * workers
    out: list[list[_Job]] = [[] for _ in range(workers)]
    for file in sorted(per_file, key=lambda f: -sum(j.nbytes for j in per_file[f])):
        w = loads.index(min(loads))
        out[w].extend(per_file[file])
        loads[w] += sum(j.nbytes for j in per_file[file])
    return [w for w in out if w]


def _run_parallel(src: str, tmp: str, assignments: list[list[_Job]], report: Callable[[int], None]) -> list[ChunkRecord]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(src, tmp, jobs, w, results), daemon=True) for w, jobs in enumerate(assignments)]
    for p in procs:
        p.start()
    records: list[ChunkRecord] = []
    pending = set(range(len(procs)))
    try:
        while pending:
            try:
                kind, wid, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in pending if not procs[w].is_alive()]
                if dead:
                    raise CheckpointError(f"reshard: worker {dead[0]} died (exit code {procs[dead[0]].exitcode})")
                continue
            if kind == "progress":
                report(payload)
            elif kind == "done":
                records.extend(payload)
                pending.discard(wid)
            else:
                raise CheckpointError(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    return records


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    world_size: int,
    strategy: str | None = None,
    policy: str | None = None,
    ep: int = 1,
    model_only: bool = False,
    dtype: str | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReshardResult:
    """Rewrite the committed checkpoint ``src`` as ``dst`` for ``world_size`` ranks with
    ``strategy`` / ``policy`` (default: the writer's, per parameter group).

    ``model_only`` drops optimizer and gradient state; ``dtype`` casts the ``model.*`` weights.
    Per-rank RNG states are kept only when the world size is unchanged (they mean nothing at
    another). ``workers`` processes write disjoint target files in parallel. ``progress(done,
    total)`` is called with bytes. ``dst`` appears only when complete (and replaces an existing
    one only with ``overwrite``); on any error nothing is left there.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    if workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {workers}")
    if ep != 1:
        raise CheckpointError(f"--ep {ep}: expert parallelism is not built in the runtime yet; only --ep 1 is supported")
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
    cast = None
    if dtype is not None:
        if dtype not in CAST_CHOICES:
            raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(CAST_CHOICES)}")
        cast = dtype_by_name(dtype)
    with CheckpointReader(src) as reader:
        if reader.manifest is None:
            raise UncommittedCheckpointError(f"{reader.directory}: no mfsdp.json: reshard needs a committed mfsdp checkpoint")
        manifest = reader.manifest
        shapes = {k[len("model."):]: reader.shape(k) for k in reader.keys() if k.startswith("model.") and reader.is_tensor(k)}
        groups, params = _target_groups(manifest, shapes, world_size, strategy, policy, reader.directory)
        source_world = manifest.get("writer", {}).get("world_size")
        jobs, dropped = _plan_jobs(reader, params, model_only=model_only, cast=cast, keep_rng=source_world == world_size)
        src_dir = reader.directory
    files = max([j.file for j in jobs], default=0) + 1
    out_manifest = {k: v for k, v in manifest.items() if k not in ("chunks", "save_id", "created_unix", "total_bytes", "format", "format_version")}
    out_manifest["writer"] = writer_layout(world_size, groups)
    if model_only:
        out_manifest.update(has_optimizer=False, include_grads=False)
    out_manifest["resharded_from"] = {"path": src_dir, "save_id": manifest.get("save_id"), "world_size": source_world,
                                      "model_only": model_only, "dtype": dtype}
    total = sum(j.nbytes for j in jobs)
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    with CheckpointBuilder(dst, out_manifest, overwrite=overwrite) as builder:
        assignments = _assign(jobs, workers)
        if len(assignments) <= 1:
            records = _run_jobs(src_dir, builder.tmp, jobs, report)
        else:
            records = _run_parallel(src_dir, builder.tmp, assignments, report)
        builder.add_records(records)
        path = builder.commit()
        written = builder.bytes_written
    return ReshardResult(path, world_size, files, len({j.key for j in jobs}), written, dropped)
