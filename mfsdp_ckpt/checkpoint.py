"""``save`` and ``load``: collective over the ranks of a ``fully_shard``-ed model.

A checkpoint is a standard DCP directory plus ``mfsdp.json`` (docs/checkpoint.md). Every tensor is stored
under its canonical key in its full logical shape, as boxes of the writer's flat shards, so it
loads into any other layout (world size, strategy, policy): each rank reads the chunks that
overlap what it owns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from mfsdp_core import ModelPlan, describe_shards, plan_of, refresh_compute_params
from mfsdp_core.collectives import rank0_decides, rank_and_world
from mfsdp_core.optim import optimizer_buffers
from mfsdp_core.plan import DEFAULT_GROUP

from . import fs
from .chunks import coverage_faults
from .errors import CheckpointError, NotACheckpointError, StateMismatchError, raise_key_problems
from .keys import MAIN_PARAM, PARAM_GROUPS, extra_key, extra_name, grad_key, model_key, optim_key, rng_key
from .manifest import MANIFEST_NAME, read_manifest, versions, writer_layout
from .planner import MfsdpLoadPlanner, MfsdpSavePlanner
from .state import FlatEntry, apply_param_groups, load_targets, save_entries
from .lock import run_lock
from .staging import check_destination, new_token, partial_path, remove_leftovers, write_file_atomic
from .storage import CommittingWriter, VerifyingReader

__all__ = ["save", "load", "resolve_checkpoint", "LATEST_NAME"]

LATEST_NAME = "latest"


def _checked_plan(model: nn.Module) -> ModelPlan:
    """The model's placement plan, refused when a buffer is sharded over a group smaller than the
    model's data-parallel group: its instances on the other groups hold different values under the
    same names, and a checkpoint keyed by name would keep only one of them."""
    plan = plan_of(model)
    dp = plan.group_sizes.get(DEFAULT_GROUP, 1)
    for spec in plan.buffers:
        if plan.group_sizes[spec.placement.group] < dp:
            raise CheckpointError(
                f"save: '{spec.fqns[0]}' is placed over group '{spec.placement.group}' "
                f"({plan.group_sizes[spec.placement.group]} of {dp} ranks), whose instances are different parameters "
                "under the same names; a canonical checkpoint cannot hold them (give them distinct names)")
    return plan


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    include_grads: bool = False,
    model_config: dict[str, Any] | None = None,
    step: int | None = None,
    keep: int | None = None,
    update_latest: bool = True,
    overwrite: bool = False,
    thread_count: int = 1,
) -> str:
    """Save ``model`` (and ``optimizer``, adapted by ``fully_shard_optimizer``) to the directory
    ``path``, atomically. Collective: every rank of the model's mesh calls it.

    ``extra``: JSON-like values saved as ``extra.<name>`` (taken from rank 0; loaded with
    ``weights_only=True``, so plain types and tensors only). Each rank's torch RNG state is saved
    too. ``include_grads`` adds ``grad.<fqn>`` (e.g. mid gradient-accumulation). ``model_config``
    and ``step`` go into the manifest. After the commit, ``<parent>/latest`` names this checkpoint
    (``update_latest``) and, with ``keep=K``, only the newest K committed checkpoints in the parent
    remain. Returns the checkpoint directory.
    """
    _local_only(path, "save")
    rank, world = rank_and_world()
    final = os.path.abspath(os.fspath(path))
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    # rank 0 checks the destination for all (and holds the run directory's lock until the save
    # is done): a failure on rank 0 alone would leave the others waiting in dcp.save's first
    # collective
    plan = _checked_plan(model)
    with contextlib.ExitStack() as lock:
        token = rank0_decides(_prepare_destination, final, overwrite, lock)
        tmp = partial_path(final, token)
        entries = save_entries(describe_shards(model, optimizer), optimizer, include_grads)
        if rank == 0:
            for name, value in (extra or {}).items():
                entries[extra_key(name)] = value
        entries[rng_key(rank)] = torch.get_rng_state()
        manifest = {
            "writer": writer_layout(world, plan),
            "model_config": model_config,
            "step": step,
            "include_grads": include_grads,
            "has_optimizer": optimizer is not None,
            "versions": versions(),
        }
        writer = CommittingWriter(tmp, final, manifest, overwrite=overwrite, thread_count=thread_count)
        try:
            dcp.save(entries, storage_writer=writer, planner=MfsdpSavePlanner(), no_dist=not dist.is_initialized())
        except CheckpointException as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _unwrap(e) from None
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # committed; every rank hears of a failure to move ``latest`` or to prune
        rank0_decides(_after_commit, final, update_latest, keep)
    return final


def _prepare_destination(final: str, overwrite: bool, lock: contextlib.ExitStack) -> str:
    """Rank 0: create the parent, take its writer lock (held in ``lock``), check ``final`` may be
    written, remove what killed saves left behind; a fresh token for the temporary directory."""
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{parent}: cannot create the checkpoint's parent directory ({e.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{parent}: not writable, cannot save {os.path.basename(final)} there")
    lock.enter_context(run_lock(parent))
    check_destination(final, overwrite=overwrite, kind="checkpoint")
    remove_leftovers(parent)  # we hold the lock: no live writer's partial is among them
    return new_token()


def _after_commit(final: str, update_latest: bool, keep: int | None) -> None:
    parent = os.path.dirname(final)
    if update_latest:
        _write_latest(parent, os.path.basename(final))
    if keep is not None:
        _prune(parent, keep, protect=final)


def _write_latest(parent: str, name: str) -> None:
    write_file_atomic(os.path.join(parent, LATEST_NAME), (name + "\n").encode())


def _prune(parent: str, keep: int, protect: str) -> None:
    """Delete all but the newest ``keep`` committed mfsdp checkpoints in ``parent``."""
    found = []
    for name in os.listdir(parent):
        d = os.path.join(parent, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(d, MANIFEST_NAME)):
            continue
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            continue
        found.append((manifest.get("created_unix", 0.0), d))
    found.sort()
    latest = resolve_checkpoint(os.path.join(parent, LATEST_NAME)) if os.path.exists(os.path.join(parent, LATEST_NAME)) else None
    for _, d in found[: max(len(found) - keep, 0)]:
        if d not in (protect, latest):
            shutil.rmtree(d, ignore_errors=True)


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A checkpoint directory from ``path`` (a local path or an fsspec URL): the directory
    itself, a ``latest`` pointer file, or a run directory holding one."""
    path = fs.normalize(path)
    if fs.isfile(path):
        name = fs.read_bytes(path).decode(errors="replace").strip()
        if not name or "/" in name or name.startswith("."):
            raise NotACheckpointError(f"{path}: not a valid '{LATEST_NAME}' pointer")
        return fs.join(fs.dirname(path), name)
    if not fs.isdir(path):
        raise NotACheckpointError(f"{path}: no such checkpoint")
    if not fs.exists(fs.join(path, ".metadata")) and fs.isfile(fs.join(path, LATEST_NAME)):
        return resolve_checkpoint(fs.join(path, LATEST_NAME))
    return path


def _local_only(path: str | os.PathLike, what: str) -> None:
    if fs.is_url(path):
        raise CheckpointError(f"{os.fspath(path)}: {what} takes a local path; fsspec URLs work with the offline tools "
                              "(mfsdp-ckpt inspect / verify / diff / reshard / convert / ls)")


def _unwrap(e: CheckpointException) -> BaseException:
    """DCP wraps each rank's failure; surface ours (the first CheckpointError) as is."""
    failures = sorted(e.failures.items())
    for _rank, (exc, _tb) in failures:
        if isinstance(exc, CheckpointError):
            return exc
    rank, (exc, _tb) = failures[0]
    return CheckpointError(f"rank {rank}: {type(exc).__name__}: {exc}")


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """torch optimizers create their state at the first step; create it now (with lr 0, which
    leaves the parameters untouched) so that a load has tensors to fill."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    borrowed = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            borrowed.append(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr):
            g["lr"] = lr
        for p in borrowed:
            p.grad = None


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    require_manifest: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), whatever layout wrote it; return the
    ``extra`` values. Collective.

    ``strict``: every model (and optimizer) key must be in the checkpoint and vice versa; all
    mismatches are named in one error. Shapes must always match. Checksums are verified for every
    chunk read. Nothing in the model or optimizer changes unless the whole load succeeds: every
    rank reads and verifies all its chunks before any is copied into place. (A fresh optimizer
    first gets its state created by a learning-rate-0 step, which leaves the parameters as they
    are.) ``require_manifest=False`` admits a stock DCP checkpoint (no ``mfsdp.json``, so no
    checksums). ``restore_rng`` restores each rank's torch RNG state when the checkpoint was
    written at the same world size.
    """
    _local_only(path, "load")
    rank, world = rank_and_world()
    # one answer for all ranks, even if ``latest`` moves while they start
    directory = rank0_decides(resolve_checkpoint, path)
    manifest = None
    if require_manifest or os.path.isfile(os.path.join(directory, MANIFEST_NAME)):
        manifest = read_manifest(directory)
    reader = VerifyingReader(directory, manifest)
    metadata = reader.read_metadata()
    if optimizer is not None:
        optimizer_buffers(optimizer)  # raises if it was not adapted by fully_shard_optimizer
        _ensure_optimizer_state(optimizer)
    shards = describe_shards(model, optimizer)
    targets_by_key, scalar_objects = _plan_targets(load_targets(shards, optimizer), metadata, optimizer is not None, strict, directory)
    for key, md in metadata.state_dict_metadata.items():
        if extra_name(key) is not None:
            if isinstance(md, BytesStorageMetadata):
                targets_by_key[key] = None
            else:
                targets_by_key[key] = torch.empty(md.size, dtype=md.properties.dtype)
    my_rng = rng_key(rank)
    writer_world = (manifest or {}).get("writer", {}).get("world_size")
    if restore_rng and writer_world == world and my_rng in metadata.state_dict_metadata:
        targets_by_key[my_rng] = torch.empty_like(torch.get_rng_state())
    if optimizer is not None and PARAM_GROUPS in metadata.state_dict_metadata:
        targets_by_key[PARAM_GROUPS] = None
    planner = MfsdpLoadPlanner()
    try:
        dcp.load(targets_by_key, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise _unwrap(e) from None
    # every rank read and verified everything: only now does anything change
    if optimizer is not None and PARAM_GROUPS in planner.objects:
        apply_param_groups(shards, optimizer, planner.objects[PARAM_GROUPS], directory)
    with torch.no_grad():
        reader.apply(planner)
        for key, (state, name) in scalar_objects:
            state[name] = planner.objects[key]
    refresh_compute_params(model)
    if my_rng in targets_by_key:
        torch.set_rng_state(targets_by_key[my_rng])
    extras = {name: v for k, v in targets_by_key.items() if (name := extra_name(k)) is not None}
    extras.update((name, v) for k, v in planner.objects.items() if (name := extra_name(k)) is not None)
    return extras


def _plan_targets(
    targets, metadata: Metadata, with_optimizer: bool, strict: bool, source: str
) -> tuple[dict[str, Any], list[tuple[str, tuple[dict, str]]]]:
    """The destination of every key to read (views of the live state), the non-tensor optimizer
    scalars to set afterwards, and the strict / shape checks, all before any byte is read."""
    saved = metadata.state_dict_metadata
    plan: dict[str, Any] = {}
    scalar_objects: list[tuple[str, tuple[dict, str]]] = []
    missing, shape_errors, coverage_errors = [], [], []
    ours: set[str] = set()

    def want(key: str, shape: torch.Size, lo: int, hi: int, dst: torch.Tensor, required: bool = True) -> None:
        ours.add(key)
        md = saved.get(key)
        if md is None:
            if required:
                missing.append(key)
            return
        if not isinstance(md, TensorStorageMetadata):
            shape_errors.append(f"{key} (not a tensor in the checkpoint)")
            return
        if tuple(md.size) != tuple(shape):
            shape_errors.append(f"{key} (checkpoint {tuple(md.size)}, model {tuple(shape)})")
            return
        if coverage_faults(key, md):
            coverage_errors.append(key)
            return
        plan[key] = FlatEntry(torch.Size(shape), lo, hi, dst)

    for t in targets:
        ps = t.shard
        lo, hi = ps.owned
        main_key = optim_key(ps.fqn, MAIN_PARAM)
        if main_key in saved:
            ours.add(model_key(ps.fqn))
            want(main_key, ps.shape, lo, hi, t.weights)
        else:
            ours.add(main_key)
            want(model_key(ps.fqn), ps.shape, lo, hi, t.weights)
        for name, dst in t.optim.items():
            want(optim_key(ps.fqn, name), ps.shape, lo, hi, dst)
        for name, value in t.optim_extra.items():
            key = optim_key(ps.fqn, name)
            ours.add(key)
            if key not in saved:
                missing.append(key)
            elif isinstance(value, torch.Tensor):
                plan[key] = value
            else:
                plan[key] = None
                scalar_objects.append((key, (t.optim_state, name)))
        if t.grad is not None and grad_key(ps.fqn) in saved:
            want(grad_key(ps.fqn), ps.shape, lo, hi, t.grad, required=False)
    unexpected = []
    if strict:
        prefixes = ("model.", "optim.") if with_optimizer else ("model.",)
        for key in saved:
            if key.startswith(prefixes) and key not in ours and key != PARAM_GROUPS:
                unexpected.append(key)
    else:
        missing = []
    raise_key_problems(source, [
        ("missing from the checkpoint", sorted(missing)),
        ("not in the model/optimizer", sorted(unexpected)),
        ("shape mismatch", sorted(shape_errors)),
        ("chunks do not cover the tensor exactly", coverage_errors),
    ], StateMismatchError)
    return plan, scalar_objects
