"""``save``: collective over the ranks of a ``fully_shard``-ed model (``load`` is its own module).

A checkpoint is a standard DCP directory plus ``mfsdp.json`` (docs/checkpoint.md). Every tensor is stored
under its canonical key in its full logical shape, as boxes of the writer's flat shards, so it
loads into any other layout (world size, strategy, policy): each rank reads the chunks that
overlap what it owns.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_ckpt.format.catalog import Catalog
from mfsdp_ckpt.format.keys import (
    PARAM_GROUPS,
    extra_key,
    rng_key,
)
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.format.model_source import gpt_source, transformers_source
from mfsdp_ckpt.sharded.base_save import base_reference, has_frozen
from mfsdp_ckpt.sharded.in_flight import wait_for_async_save
from mfsdp_ckpt.sharded.own_chunks import write_own_chunks
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.sharded.save_layout import agree_on_layout, writes_of
from mfsdp_ckpt.sharded.state import save_entries
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_ckpt.write.destination import Destination, destination_for
from mfsdp_ckpt.write.job import write_and_commit
from mfsdp_ckpt.write.run_dir import after_commit
from mfsdp_ckpt.write.save_index import RankWrites, build_index
from mfsdp_core import describe_shards
from mfsdp_core.collectives import rank0_decides, rank_and_world

__all__ = [
    "save",
    "PreparedSave",
    "SaveContents",
    "check_save_arguments",
    "prepare_save",
    "save_contents",
    "write_save",
]

T = TypeVar("T")


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
    frozen_once: bool = True,
) -> str:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically. Collective: every
    rank of the model's mesh calls it. An asynchronous save of this process still in flight
    (:func:`mfsdp_ckpt.async_save`) is waited for first (its handle reports its outcome). Each
    rank's torch RNG state is saved too. Under expert parallelism each rank's experts are stored
    under their global names, the manifest records the plan merged over all ranks and
    ``writer.experts`` (which EP rank held which experts), and ``optim.param_groups`` names every
    rank's parameters.

    Args:
        path: the checkpoint directory, or an fsspec URL (``s3://bucket/run/step_10``): each rank
            uploads its data file straight to that prefix and rank 0 commits by writing
            ``mfsdp.json`` last. No run-directory lock there: one writer per prefix is the
            caller's responsibility (docs/checkpoint.md).
        model: the ``fully_shard``-ed model.
        optimizer: its optimizer, adapted by ``fully_shard_optimizer``, or None.
        extra: JSON-like values saved as ``extra.<name>`` (taken from rank 0; loaded with
            ``weights_only=True``, so plain types and tensors only).
        include_grads: add ``grad.<fqn>`` (e.g. mid gradient-accumulation).
        model_config: recorded in the manifest; without ``model_source`` it is recorded as a
            reference ``GPTModel``'s (a ``transformers`` model records its class and config).
        step: recorded in the manifest.
        keep: after the commit only the newest ``keep`` committed checkpoints in the parent remain.
        update_latest: after the commit ``<parent>/latest`` names this checkpoint.
        overwrite: replace an existing checkpoint at ``path`` (on an object store the old one is
            un-committed first: its ``mfsdp.json`` deleted before anything else).
        thread_count: writer threads (data files) per rank.
        run_config: the settings a resumed run must keep (a trainer compares them), recorded in
            the manifest.
        model_source: what the weights belong to and what rebuilds the model
            (:mod:`mfsdp_ckpt.format.model_source`), recorded in the manifest.
        frozen_once: a model with frozen parameters (``requires_grad=False``: LoRA, frozen
            embeddings) writes their weights once, into a base checkpoint beside ``path``
            (``base_step_<N>``), and this checkpoint references it (docs/lora.md); False writes
            them into every checkpoint. A model without frozen parameters is not affected.

    Returns:
        The checkpoint directory.
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
            frozen_once=frozen_once,
        )
        write_save(job, job.entries, MfsdpSavePlanner())
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
    catalog: Catalog
    destination: Destination


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
    frozen_once: bool = True,
) -> PreparedSave:
    """Everything ``save`` does before writing: every refusal (on every rank alike), the
    destination's checks, the run directory's lock (entered into ``lock`` on rank 0; the caller
    closes it once the save is done), the entries and the manifest. Collective (default group)."""
    check_save_arguments(path, keep)
    final = fs.normalize(path)
    contents = save_contents(
        model,
        optimizer,
        extra=extra,
        include_grads=include_grads,
        model_config=model_config,
        step=step,
        run_config=run_config,
        model_source=model_source,
    )
    entries, manifest = contents.entries, contents.manifest
    if frozen_once and has_frozen(contents.catalog):  # frozen weights: in a base, written once
        reference = base_reference(final, entries, manifest, contents.catalog, step=step, thread_count=thread_count)
        manifest = {**manifest, "base": reference}
    # rank 0 checks the destination for all (and holds the run directory's lock until the save
    # is done): a failure on rank 0 alone would leave the others waiting in the first
    # collective of the write
    destination = destination_for(final)
    lock.callback(destination.close)  # rank 0 holds the parent's lock until the save is done
    tmp = rank0_decides(lambda: destination.open(overwrite=overwrite, clean_parent=True))
    writer = CommittingWriter(destination, tmp, manifest, thread_count=thread_count)
    return PreparedSave(final, tmp, entries, writer, update_latest, keep, contents.catalog, destination)


@dataclass
class SaveContents:
    """What a save writes, whatever its destination: the entries (views of the live state; this
    rank's pieces it is the writer of, rank 0's extras), the manifest, and the catalog the ranks
    agreed on (what the index is checked against)."""

    entries: dict[str, Any]
    manifest: dict[str, Any]
    catalog: Catalog


def save_contents(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra: dict[str, Any] | None,
    include_grads: bool,
    model_config: dict[str, Any] | None,
    step: int | None,
    run_config: dict[str, Any] | None = None,
    model_source: dict[str, Any] | None = None,
) -> SaveContents:
    """The entries and manifest of a save (shared by ``save``, ``async_save`` and the memory
    tier's snapshots, so that all write the same keys and manifest). Collective: the ranks agree
    on the layout first (a refusal before anything is written)."""
    rank, world = rank_and_world()
    shards = describe_shards(model, optimizer)
    layout = agree_on_layout(model, optimizer, shards, include_grads=include_grads)
    entries = save_entries(shards, optimizer, include_grads, writes_of(layout.catalog, rank))
    if rank == 0:
        if layout.param_groups is not None:
            entries[PARAM_GROUPS] = layout.param_groups
        for name, value in (extra or {}).items():
            entries[extra_key(name)] = value
    entries[rng_key(rank)] = torch.get_rng_state()
    manifest = {
        "writer": writer_layout(world, layout.plan, layout.experts),
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
    return SaveContents(entries, manifest, layout.catalog)


def write_save(
    job: PreparedSave,
    entries: dict[str, Any],
    planner: MfsdpSavePlanner,
    *,
    process_group: dist.ProcessGroup | None = None,
    decide: Callable[..., Any] | None = None,
) -> None:
    """Write ``entries`` (``job.entries`` or a copy of them) on the offline tools' protocol
    (:func:`mfsdp_ckpt.write.job.write_and_commit`): each rank plans and writes its own chunks
    (what the catalog the ranks agreed on gives it), rank 0 gathers what was written, checks it
    against the catalog and commits; then ``latest`` moves and old checkpoints are pruned.
    Collective over ``process_group``. On a failure anywhere rank 0 removes the staging
    directory and every rank raises the same one-line error (``same_error``). ``decide`` runs a
    function on rank 0 and gives every rank its outcome (default: ``rank0_decides`` over the
    default group)."""
    ranks = Job.current(process_group, same_error=True)

    def conclude(parts: list[RankWrites]) -> None:
        metadata, results, index = build_index(job.catalog, parts)
        job.writer.commit(metadata, results, index)

    write_and_commit(
        ranks,
        f"{job.final}: not saved",
        job.tmp,  # opened by prepare_save (rank 0 told every rank), before anything was staged
        lambda _: write_own_chunks(job.writer, entries, planner, ranks.rank),
        conclude,
        job.destination.abort,
    )
    # committed; every rank hears of a failure to move ``latest`` or to prune
    (decide or rank0_decides)(after_commit, job.final, job.update_latest, job.keep)
