"""``save``: collective over the ranks of a ``fully_shard``-ed model (``load`` is its own module).

A checkpoint is a standard DCP directory plus ``mfsdp.json`` (docs/checkpoint.md). Every tensor is stored
under its canonical key in its full logical shape, as boxes of the writer's flat shards, so it
loads into any other layout (world size, strategy, policy): each rank reads the chunks that
overlap what it owns.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from mfsdp_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
)
from mfsdp_ckpt.format.keys import (
    PARAM_GROUPS,
    extra_key,
    rng_key,
)
from mfsdp_ckpt.format.model_source import gpt_source, transformers_source
from mfsdp_ckpt.format.names import MANIFEST_NAME
from mfsdp_ckpt.read.manifest import versions, writer_layout
from mfsdp_ckpt.sharded.agreement import dcp_failure
from mfsdp_ckpt.sharded.experts import (
    experts_entry,
    merge_param_groups,
    merge_plans,
)
from mfsdp_ckpt.sharded.in_flight import wait_for_async_save
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.sharded.state import (
    param_groups_state,
    save_entries,
)
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.lock import run_lock
from mfsdp_ckpt.storage.staging import (
    check_destination,
    new_token,
    partial_path,
    remove_leftovers,
)
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_ckpt.write.run_dir import after_commit, discard, remove_checkpoint
from mfsdp_core import ModelPlan, describe_shards, plan_of
from mfsdp_core.collectives import gather_objects, rank0_decides, rank_and_world
from mfsdp_core.expert_parallel import EP_GROUP, ep_rank_of
from mfsdp_core.plan import DEFAULT_GROUP

__all__ = ["save", "PreparedSave", "check_save_arguments", "prepare_save", "write_and_commit"]

T = TypeVar("T")


def _global_plan(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, shards: list
) -> tuple[ModelPlan, dict[str, Any] | None, list[dict[str, Any]] | None]:
    """The plan of the whole model, the manifest's ``writer.experts`` entry (None without expert
    parallelism) and, when the ranks hold different parameters, the optimizer's groups naming the
    parameters of every rank (None: this rank's own are complete).

    When every buffer is sharded over the model's data-parallel group, every rank holds every
    parameter and its plan is the whole one. A buffer over a smaller group (experts over their
    expert-data-parallel group) exists on each rank only for that rank's parameters: every rank's
    plan and groups are gathered (one ``all_gather_object``) and merged, refused on every rank
    alike when one name is held by more ranks than its group has (several instances of one name,
    which a checkpoint keyed by name cannot keep; see :func:`~mfsdp_ckpt.sharded.experts.merge_plans`)."""
    plan = plan_of(model)
    dp = plan.group_sizes.get(DEFAULT_GROUP, 1)
    ep_rank, ep_size = ep_rank_of(model)
    with_ep = EP_GROUP in plan.group_sizes
    if all(plan.group_sizes[spec.placement.group] * spec.replicate_size >= dp for spec in plan.buffers):
        names = [n for spec in plan.buffers for n in spec.fqns]
        return plan, experts_entry(ep_size, [(ep_rank, names)]) if with_ep else None, None
    groups = param_groups_state(shards, optimizer) if optimizer is not None else None
    gathered = gather_objects((plan.to_dict(), ep_rank, groups))
    merged = ModelPlan.from_dict(merge_plans([p for p, _, _ in gathered]))
    experts = None
    if with_ep:
        experts = experts_entry(ep_size, [(r, [n for b in p["buffers"] for n in b["params"]]) for p, r, _ in gathered])
    all_groups = merge_param_groups([g for _, _, g in gathered]) if optimizer is not None else None
    return merged, experts, all_groups


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
    run_config: dict[str, Any] | None = None,
    model_source: dict[str, Any] | None = None,
) -> str:
    """Save ``model`` (and ``optimizer``, adapted by ``fully_shard_optimizer``) to the directory
    ``path``, atomically. Collective: every rank of the model's mesh calls it.

    ``extra``: JSON-like values saved as ``extra.<name>`` (taken from rank 0; loaded with
    ``weights_only=True``, so plain types and tensors only). Each rank's torch RNG state is saved
    too. ``include_grads`` adds ``grad.<fqn>`` (e.g. mid gradient-accumulation). ``model_source``
    (what the weights belong to and what rebuilds the model: :mod:`mfsdp_ckpt.format.model_source`;
    without it, ``model_config`` is recorded as a reference ``GPTModel``'s, and a ``transformers``
    model records its class and config), ``model_config``,
    ``step`` and ``run_config`` (the settings a resumed run must keep: a trainer compares them) go
    into the manifest. After the commit, ``<parent>/latest`` names this checkpoint
    (``update_latest``) and, with ``keep=K``, only the newest K committed checkpoints in the parent
    remain. Under expert parallelism each rank's experts are stored under their global names,
    the manifest records the plan merged over all ranks and ``writer.experts`` (which EP rank held
    which experts), and ``optim.param_groups`` names every rank's parameters. Returns the
    checkpoint directory. An asynchronous save of this process still in flight
    (:func:`mfsdp_ckpt.async_save`) is waited for first (its handle reports its outcome).

    ``path`` may be an fsspec URL (``s3://bucket/run/step_10``): each rank uploads its data file
    straight to that prefix and rank 0 commits by writing ``mfsdp.json`` last; ``overwrite`` first
    un-commits the old checkpoint (see :func:`_prepare_remote`). No run-directory lock there: one
    writer per prefix is the caller's responsibility (docs/checkpoint.md).
    """
    wait_for_async_save()
    with contextlib.ExitStack() as lock:
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
        write_and_commit(job, job.entries, MfsdpSavePlanner())
    return job.final


@dataclass
class PreparedSave:
    """A save whose refusals have all passed, ready to write: the final and temporary
    directories, the entries to write (views of the live state), the writer that commits them,
    and what to do after the commit. Built by :func:`prepare_save` (shared by ``save`` and
    ``async_save``, so that both refuse alike and write the same keys and manifest)."""

    final: str
    tmp: str
    entries: dict[str, Any]
    writer: CommittingWriter
    update_latest: bool
    keep: int | None


def check_save_arguments(path: str | os.PathLike, keep: int | None) -> None:
    """The refusals of ``save`` that depend on its arguments alone (the same on every rank)."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")


def prepare_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra: dict[str, Any] | None,
    include_grads: bool,
    model_config: dict[str, Any] | None,
    step: int | None,
    keep: int | None,
    update_latest: bool,
    overwrite: bool,
    thread_count: int,
    lock: contextlib.ExitStack,
    run_config: dict[str, Any] | None = None,
    model_source: dict[str, Any] | None = None,
) -> PreparedSave:
    """Everything ``save`` does before writing: every refusal (on every rank alike), the
    destination's checks, the run directory's lock (entered into ``lock`` on rank 0; the caller
    closes it once the save is done), the entries and the manifest. Collective (default group)."""
    check_save_arguments(path, keep)
    rank, world = rank_and_world()
    final = fs.normalize(path)
    # rank 0 checks the destination for all (and holds the run directory's lock until the save
    # is done): a failure on rank 0 alone would leave the others waiting in dcp.save's first
    # collective
    shards = describe_shards(model, optimizer)
    plan, experts, groups = _global_plan(model, optimizer, shards)  # refused before anything is written
    if not fs.is_local(final):
        tmp = rank0_decides(_prepare_remote, final, overwrite)
    else:
        tmp = partial_path(final, rank0_decides(_prepare_destination, final, overwrite, lock))
    entries = save_entries(shards, optimizer, include_grads)
    if groups is not None:
        entries[PARAM_GROUPS] = groups
    if rank == 0:
        for name, value in (extra or {}).items():
            entries[extra_key(name)] = value
    entries[rng_key(rank)] = torch.get_rng_state()
    manifest = {
        "writer": writer_layout(world, plan, experts),
        "model_config": model_config,
        "model_source": (
            model_source
            if model_source is not None
            else gpt_source(model_config)
            if model_config
            else transformers_source(model)
        ),
        **({"run_config": run_config} if run_config is not None else {}),
        "step": step,
        "include_grads": include_grads,
        "has_optimizer": optimizer is not None,
        "versions": versions(),
    }
    writer = CommittingWriter(tmp, final, manifest, overwrite=overwrite, thread_count=thread_count)
    return PreparedSave(final, tmp, entries, writer, update_latest, keep)


def write_and_commit(
    job: PreparedSave,
    entries: dict[str, Any],
    planner: MfsdpSavePlanner,
    *,
    process_group: dist.ProcessGroup | None = None,
    decide: Callable[..., Any] | None = None,
) -> None:
    """Write ``entries`` (``job.entries`` or a copy of them) with DCP over ``process_group``,
    commit, then move ``latest`` and prune. On a failure rank 0 removes the temporary directory
    and every rank raises the same one-line error. ``decide`` runs a function on rank 0 and
    gives every rank its outcome (default: ``rank0_decides`` over the default group)."""
    rank, _ = rank_and_world()
    try:
        with warnings.catch_warnings():  # DCP's notice that no_dist writes "in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(
                entries,
                storage_writer=job.writer,
                planner=planner,
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as e:
        if rank == 0:
            discard(job.tmp)
        raise dcp_failure(e) from None
    except BaseException:
        if rank == 0:
            discard(job.tmp)
        raise
    # committed; every rank hears of a failure to move ``latest`` or to prune
    (decide or rank0_decides)(after_commit, job.final, job.update_latest, job.keep)


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


def _prepare_remote(final: str, overwrite: bool) -> str:
    """Rank 0, for a save to an fsspec URL: the bucket exists; what killed saves left in the
    parent (prefixes of checkpoint files without ``mfsdp.json``) is removed; an existing
    checkpoint at ``final`` is refused, or with ``overwrite`` un-committed (its ``mfsdp.json``
    deleted first, so that an interrupted overwrite leaves an uncommitted prefix, never a mix that
    looks complete) and removed. Returns ``final``: the files go straight there."""
    from mfsdp_ckpt.storage.objstore import check_bucket, remove_uncommitted
    from mfsdp_ckpt.storage.remote import retrying

    check_bucket(final)
    parent = fs.dirname(final)
    remove_uncommitted(parent)
    if fs.exists(final):
        manifest = fs.join(final, MANIFEST_NAME)
        if not overwrite:
            raise CheckpointExistsError(f"{final}: already exists (pass overwrite=True to replace it)")
        if not fs.isfile(manifest):
            raise CheckpointError(f"{final}: exists and is not a checkpoint; refusing to replace it")
        retrying(final, "delete", lambda: remove_checkpoint(final))
    return final
