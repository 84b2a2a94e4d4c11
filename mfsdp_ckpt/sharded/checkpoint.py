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
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    StateMismatchError,
    raise_key_problems,
)
from mfsdp_ckpt.format.keys import (
    MAIN_PARAM,
    PARAM_GROUPS,
    extra_key,
    extra_name,
    fqn_of_model_key,
    grad_key,
    model_key,
    optim_key,
    rng_key,
)
from mfsdp_ckpt.format.model_source import gpt_source, transformers_source
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME, MANIFEST_NAME, PARTIAL_MARK
from mfsdp_ckpt.read.chunks import ChunkFiles, coverage_faults
from mfsdp_ckpt.read.dcp_reader import VerifyingReader
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.read.manifest import is_committed, read_manifest, versions, writer_layout
from mfsdp_ckpt.read.mapped import map_reader_keys
from mfsdp_ckpt.read.metadata_check import entry_faults
from mfsdp_ckpt.read.staged_read import DEFAULT_READ_THREADS
from mfsdp_ckpt.read.stock import KeyRule, missing_summary, parse_key_map, stock_param_groups
from mfsdp_ckpt.sharded.experts import (
    expert_count_problem,
    expert_counts,
    experts_entry,
    gather_objects,
    merge_param_groups,
    merge_plans,
)
from mfsdp_ckpt.sharded.mx_load import check_planes, mx_targets, write_planes
from mfsdp_ckpt.sharded.planner import MfsdpLoadPlanner, MfsdpSavePlanner
from mfsdp_ckpt.sharded.state import (
    FlatEntry,
    load_targets,
    param_group_updates,
    param_groups_state,
    save_entries,
)
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.lock import run_lock
from mfsdp_ckpt.storage.staging import (
    check_destination,
    fsync_dir,
    new_token,
    partial_path,
    remove_leftovers,
)
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_core import ModelPlan, describe_shards, plan_of, refresh_compute_params
from mfsdp_core.collectives import rank0_decides, rank_and_world
from mfsdp_core.expert_parallel import EP_GROUP, ep_rank_of
from mfsdp_core.optim import optimizer_buffers
from mfsdp_core.plan import DEFAULT_GROUP

__all__ = ["save", "load", "PreparedSave", "check_save_arguments", "prepare_save", "write_and_commit"]

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
    if all(plan.group_sizes[spec.placement.group] >= dp for spec in plan.buffers):
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
    for wait in _before_save:
        wait()
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


_before_save: list[Callable[[], None]] = []  # run by ``save`` first (async_save registers: wait for its save in flight)


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
    if fs.is_url(final):
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
        dcp.save(
            entries,
            storage_writer=job.writer,
            planner=planner,
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as e:
        if rank == 0:
            _discard(job.tmp)
        raise _unwrap(e) from None
    except BaseException:
        if rank == 0:
            _discard(job.tmp)
        raise
    # committed; every rank hears of a failure to move ``latest`` or to prune
    (decide or rank0_decides)(_after_commit, job.final, job.update_latest, job.keep)


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
        retrying(manifest, "delete", lambda: fs.remove_tree(manifest))
        retrying(final, "delete", lambda: fs.remove_tree(final))
    return final


def _discard(tmp: str) -> None:
    """Rank 0, after a failed save: remove what it wrote (a local partial directory, or the
    uncommitted prefix on an object store; a failure there is left for the next save)."""
    if not fs.is_url(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    with contextlib.suppress(Exception):
        fs.remove_tree(fs.join(tmp, MANIFEST_NAME))  # first: should its upload have landed after all
    with contextlib.suppress(Exception):
        fs.remove_tree(tmp)


def _after_commit(final: str, update_latest: bool, keep: int | None) -> None:
    parent = fs.dirname(final)
    if update_latest:
        _write_latest(parent, final.rsplit("/", 1)[-1] if fs.is_url(final) else os.path.basename(final))
    if keep is not None:
        _prune(parent, keep, protect=final)


def _write_latest(parent: str, name: str) -> None:
    """``<parent>/latest``: locally a rename into place; on an object store one PUT. Locally also
    the symlink ``<parent>/latest-checkpoint`` -> ``name`` (after the pointer, which is what our
    readers follow)."""
    fs.write_bytes(fs.join(parent, LATEST_NAME), (name + "\n").encode())
    if not fs.is_url(parent):
        _link_latest(parent, name)


def _link_latest(parent: str, name: str) -> None:
    """Point the symlink ``latest-checkpoint`` at ``name``, atomically: a new link under a
    partial name renamed over the old one. A file system without symlinks gets a warning (the
    pointer file is already written)."""
    link = os.path.join(parent, LATEST_LINK_NAME)
    if os.path.lexists(link) and not os.path.islink(link):
        warnings.warn(
            f"{link}: not a symlink (a copy of the run?); left as it is; '{LATEST_NAME}' names the latest", stacklevel=2
        )
        return
    tmp = os.path.join(parent, f".{LATEST_LINK_NAME}{PARTIAL_MARK}{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, link)
        fsync_dir(parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        warnings.warn(
            f"{link}: cannot link the latest checkpoint ({e.strerror or e}); '{LATEST_NAME}' names it", stacklevel=2
        )


def _prune(parent: str, keep: int, protect: str) -> None:
    """Delete all but the newest ``keep`` committed mfsdp checkpoints in ``parent`` (on an object
    store: their whole prefixes, manifest first)."""
    found = []
    for name in fs.listdir(parent):
        d = fs.join(parent, name)
        if name.startswith(".") or (not fs.is_url(d) and os.path.islink(d)) or not fs.isfile(fs.join(d, MANIFEST_NAME)):
            continue  # the latest-checkpoint symlink is not a checkpoint of its own
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            continue
        found.append((manifest.get("created_unix", 0.0), d))
    found.sort()
    pointer = fs.join(parent, LATEST_NAME)
    latest = resolve_checkpoint(pointer) if fs.exists(pointer) else None
    for _, d in found[: max(len(found) - keep, 0)]:
        if d not in (protect, latest):
            if fs.is_url(d):
                with contextlib.suppress(Exception):
                    fs.remove_tree(fs.join(d, MANIFEST_NAME))  # no longer a checkpoint, even if the rest stays
            fs.remove_tree(d)


def _unwrap(e: CheckpointException, rank: int | None = None) -> BaseException:
    """DCP wraps each rank's failure; surface ours (the first CheckpointError) as is. ``rank``:
    the rank to name when DCP ran without a process group (it numbers that one rank 0)."""
    failures = sorted(e.failures.items())
    for _rank, (exc, _tb) in failures:
        if isinstance(exc, CheckpointError):
            return exc
    failed, (exc, _tb) = failures[0]
    return CheckpointError(f"rank {failed if rank is None else rank}: {type(exc).__name__}: {exc}")


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
    thread_count: int = DEFAULT_READ_THREADS,
    key_map: Sequence[str | KeyRule] = (),
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
    written at the same world size. The ranks agree on every refusal (a key is unexpected only
    when no rank wants it: under expert parallelism each wants its own experts), so all raise the
    same error; a checkpoint with another number of experts than the model is refused first.
    ``path`` may be an fsspec URL (``s3://…``): each rank reads the byte ranges of the chunks it
    needs, with the client's retries. ``thread_count``: reader threads per rank (see
    :mod:`mfsdp_ckpt.read.staged_read`).

    A stock checkpoint's keys are read in canonical form (FSDP2's ``get_state_dict`` layout:
    ``optim.state.<fqn>.<state>``, ``optim.param_groups.<…>.<hp>``), after ``key_map``'s
    ``OLD=NEW`` prefix renames (e.g. ``['=model.']`` for torchtitan's bare FQNs; see
    :mod:`mfsdp_ckpt.read.stock`). With ``strict=False`` the keys not found are reported, by group, in
    one ``UserWarning`` (the same on every rank), which says so when no optimizer state was loaded.
    """
    rules = parse_key_map(key_map)
    rank, world = rank_and_world()
    # one answer for all ranks, even if ``latest`` moves while they start
    directory = rank0_decides(resolve_checkpoint, path)
    manifest = None
    if require_manifest or is_committed(directory):
        manifest = read_manifest(directory)
    reader = VerifyingReader(directory, manifest, thread_count=thread_count)
    try:
        metadata = reader.read_metadata()
        group_parts = map_reader_keys(reader, rules, manifest)  # canonical names from here on
        metadata = reader.read_metadata()
        saved = metadata.state_dict_metadata
        _check_expert_count(model, saved, directory)
        if optimizer is not None:
            optimizer_buffers(optimizer)  # raises if it was not adapted by fully_shard_optimizer
            _ensure_optimizer_state(optimizer)
        shards = describe_shards(model, optimizer)
        targets_by_key, scalar_objects, found = _plan_targets(
            load_targets(shards, optimizer), metadata, optimizer is not None
        )
        mx, mx_problems = mx_targets(shards, saved)
        found.shape_errors.extend(mx_problems)
        found.claimed.update(group_parts)
        main_entries = {t.main_key: targets_by_key[t.main_key] for t in mx if t.main_key in targets_by_key}
        for t in mx:
            targets_by_key.update(t.planes.values())
        extra_keys = [key for key in saved if extra_name(key) is not None]
        my_rng = rng_key(rank)
        writer_world = ((manifest or {}).get("writer") or {}).get("world_size")
        rng_state = torch.get_rng_state()
        restore = restore_rng and writer_world == world and my_rng in saved
        groups = optimizer is not None and (PARAM_GROUPS in saved or bool(group_parts))

        def check_before_reading() -> None:
            if restore and not (
                isinstance(saved[my_rng], TensorStorageMetadata)
                and tuple(saved[my_rng].size) == tuple(rng_state.shape)
                and saved[my_rng].properties.dtype == rng_state.dtype
            ):
                raise CorruptCheckpointError(
                    f"{directory}: key '{my_rng}': not a {tuple(rng_state.shape)} uint8 tensor (a torch RNG state)"
                )
            if groups and not isinstance(saved.get(PARAM_GROUPS, BytesStorageMetadata()), BytesStorageMetadata):
                raise CorruptCheckpointError(
                    f"{directory}: key '{PARAM_GROUPS}': stored as a tensor, expected the optimizer's groups"
                )
            # every entry to read is sound and its bytes are present: checked before allocating anything
            _check_entries(
                reader,
                directory,
                [
                    *targets_by_key,
                    *extra_keys,
                    *([my_rng] if restore else []),
                    *(([PARAM_GROUPS] if PARAM_GROUPS in saved else group_parts) if groups else []),
                ],
            )

        # one gather for both: the key problems of every rank (raised first, the same on all), then
        # the first failure of the entry checks
        _, failure, views = _run_and_gather(check_before_reading, _key_view(found, saved))
        not_found = _agree_on_keys(views, saved, optimizer is not None, strict, directory)
        if failure is not None:
            raise failure
        if not strict:
            _report_not_found(
                not_found,
                optimizer is not None
                and not any(k.startswith("optim.") and k != PARAM_GROUPS and k in targets_by_key for k in saved),
                directory,
            )
        for key in extra_keys:
            md = saved[key]
            targets_by_key[key] = (
                None if isinstance(md, BytesStorageMetadata) else torch.empty(md.size, dtype=md.properties.dtype)
            )
        if restore:
            targets_by_key[my_rng] = torch.empty_like(rng_state)
        if groups:
            targets_by_key.update((key, None) for key in ([PARAM_GROUPS] if PARAM_GROUPS in saved else group_parts))
        planner = MfsdpLoadPlanner()

        # Each rank plans and reads its own chunks (DCP's ``no_dist``: a load plan needs nothing from
        # the other ranks, and central planning would cost two gathers and a scatter per load); the
        # ranks then agree once, below, on every failure of the read and of the checks after it.
        # What follows changes nothing until every rank has read, verified and checked everything.
        def read_and_check() -> list[dict[str, Any]] | None:
            try:
                with warnings.catch_warnings():  # DCP's notice that no_dist reads "in a single process"
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                    dcp.load(targets_by_key, storage_reader=reader, planner=planner, no_dist=True)
            except CheckpointException as e:
                raise _unwrap(e, rank) from None
            check_planes(mx, reader, main_entries, directory)
            if restore:
                try:
                    torch.Generator().set_state(reader.preview(my_rng, targets_by_key[my_rng]))
                except (RuntimeError, ValueError, TypeError) as e:
                    raise CorruptCheckpointError(
                        f"{directory}: key '{my_rng}': not a valid torch RNG state ({type(e).__name__})"
                    ) from None
            if not groups:
                return None
            if PARAM_GROUPS not in saved:  # a stock checkpoint's entries, one per (group, hyper-parameter)
                planner.objects[PARAM_GROUPS] = stock_param_groups(group_parts, planner.objects.__getitem__, rules)
            _check_param_groups(planner.objects.get(PARAM_GROUPS), directory)
            return param_group_updates(shards, optimizer, planner.objects[PARAM_GROUPS], directory)

        updates = _agreed(read_and_check)
        if updates is not None:
            for group, update in zip(optimizer.param_groups, updates):
                group.update(update)
        with torch.no_grad():
            reader.apply(planner)
            for key, (state, name) in scalar_objects:
                state[name] = planner.objects[key]
        refresh_compute_params(model)
        with torch.no_grad():
            if write_planes(mx):  # planes that cannot be derived exactly: as saved
                refresh_compute_params(model, derive_companions=False)
        if restore:
            torch.set_rng_state(targets_by_key[my_rng])
        extras = {name: v for k, v in targets_by_key.items() if (name := extra_name(k)) is not None}
        extras.update((name, v) for k, v in planner.objects.items() if (name := extra_name(k)) is not None)
        return extras
    finally:
        reader.close()  # the data files a load keeps open between reading and copying


def _check_entries(reader: VerifyingReader, directory: str, keys: list[str]) -> None:
    """Refuse, before anything is allocated or read, an entry to load whose metadata is not sound
    (:func:`~mfsdp_ckpt.read.metadata_check.entry_faults`) or whose chunks' files do not hold their
    byte ranges. Every rank checks the same keys of the same files, so all fail alike."""
    saved = reader.read_metadata().state_dict_metadata
    problems = []
    for key in sorted(set(keys)):
        faults = entry_faults(key, saved[key], reader.stored.get(key, []))
        if faults:
            problems.append(str(faults[0]))
    if problems:
        more = f" (and {len(problems) - 3} more entries)" if len(problems) > 3 else ""
        raise CorruptCheckpointError(f"{directory}: " + "; ".join(problems[:3]) + more)
    with ChunkFiles(directory, None) as files:
        for key in sorted(set(keys)):
            files.require_present(reader.stored.get(key, []))


def _check_param_groups(groups: Any, directory: str) -> None:
    """The saved optimizer groups have the shape ``apply_param_groups`` reads: a list of dicts
    with string keys, each naming its parameters in a list of strings."""
    ok = isinstance(groups, list) and all(
        isinstance(g, dict)
        and all(isinstance(k, str) for k in g)
        and isinstance(g.get("params"), list)
        and all(isinstance(n, str) for n in g["params"])
        for g in groups
    )
    if not ok:
        raise CorruptCheckpointError(
            f"{directory}: key '{PARAM_GROUPS}': not a list of parameter groups naming their parameters"
        )


def _plan_targets(
    targets, metadata: Metadata, with_optimizer: bool
) -> tuple[dict[str, Any], list[tuple[str, tuple[dict, str]]], _KeyProblems]:
    """The destination of every key to read (views of the live state), the non-tensor optimizer
    scalars to set afterwards, and this rank's key and shape problems (which
    :func:`_agree_on_keys` combines over the ranks), all before any byte is read."""
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
            md = saved.get(key)
            if md is None:
                missing.append(key)
            elif isinstance(value, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    shape_errors.append(f"{key} (not a tensor in the checkpoint)")
                elif tuple(md.size) != tuple(value.shape):
                    shape_errors.append(f"{key} (checkpoint {tuple(md.size)}, optimizer {tuple(value.shape)})")
                else:
                    plan[key] = value
            elif not isinstance(md, BytesStorageMetadata):
                shape_errors.append(f"{key} (a tensor in the checkpoint, a {type(value).__name__} in the optimizer)")
            else:
                plan[key] = None
                scalar_objects.append((key, (t.optim_state, name)))
        if t.grad is not None and grad_key(ps.fqn) in saved:
            want(grad_key(ps.fqn), ps.shape, lo, hi, t.grad, required=False)
    return plan, scalar_objects, _KeyProblems(missing, shape_errors, coverage_errors, ours)


@dataclass
class _KeyProblems:
    """One rank's view of the keys: what it wants that the checkpoint lacks, shape and coverage
    problems, and every key it claims (wanted, or stood in for by another)."""

    missing: list[str]
    shape_errors: list[str]
    coverage_errors: list[str]
    claimed: set[str]


def _key_view(found: _KeyProblems, saved: dict[str, Any]) -> tuple[list[str], list[str], list[str], bytes]:
    """What one rank tells the others about the keys (:func:`_agree_on_keys`): its problems, and
    which of the checkpoint's keys (in sorted order) it claims, one byte each."""
    return (
        found.missing,
        found.shape_errors,
        found.coverage_errors,
        bytes(key in found.claimed for key in sorted(saved)),
    )


def _agree_on_keys(
    views: list[tuple[list[str], list[str], list[str], bytes]],
    saved: dict[str, Any],
    with_optimizer: bool,
    strict: bool,
    source: str,
) -> list[str]:
    """Raise the same :class:`StateMismatchError` on every rank, or none, from every rank's
    :func:`_key_view`. A checkpoint key is unexpected only when no rank claims it: under expert
    parallelism each rank wants only its own experts. Returns the keys some rank wants that the
    checkpoint lacks (an error when ``strict``)."""
    keys = sorted(saved)
    anyone = [any(v[3][i] for v in views) for i in range(len(keys))]
    missing, unexpected = {k for v in views for k in v[0]}, []
    if strict:
        prefixes = ("model.", "optim.") if with_optimizer else ("model.",)
        unexpected = [k for k, c in zip(keys, anyone) if k.startswith(prefixes) and not c and k != PARAM_GROUPS]
    raise_key_problems(
        source,
        [
            ("missing from the checkpoint", sorted(missing) if strict else []),
            ("not in the model/optimizer", unexpected),
            ("shape mismatch", sorted({e for v in views for e in v[1]})),
            ("chunks do not cover the tensor exactly", sorted({k for v in views for k in v[2]})),
        ],
        StateMismatchError,
    )
    return sorted(missing)


def _report_not_found(missing: list[str], no_optimizer_state: bool, source: str) -> None:
    """``strict=False``: one warning naming, by group, what the checkpoint lacks, and saying so
    when the optimizer gets no state at all (it keeps what it has)."""
    parts = [f"not in the checkpoint: {missing_summary(missing)}"] if missing else []
    if no_optimizer_state:
        parts.append("no optimizer state was loaded (the optimizer keeps its current state)")
    if parts:
        warnings.warn(f"{source}: load(strict=False): " + "; ".join(parts), stacklevel=3)


def _check_expert_count(model: nn.Module, saved: dict[str, Any], source: str) -> None:
    """Refuse, on every rank and before anything changes, a checkpoint whose number of experts
    differs from the model's for an expert template both have. The model's experts are counted
    over the ranks (under expert parallelism each holds some); gathered only when the checkpoint
    has experts (the same answer on every rank: they read the same metadata)."""
    stored = expert_counts(name for key in saved if (name := fqn_of_model_key(key)) is not None)
    if not stored:
        return
    mine = expert_counts(plan_of(model).params())
    model_counts: dict[str, set[int]] = {}
    for counts in gather_objects(mine):
        for template, indices in counts.items():
            model_counts.setdefault(template, set()).update(indices)
    problem = expert_count_problem(stored, model_counts)
    if problem is not None:
        raise StateMismatchError(f"{source}: {problem}")


def _run_and_gather(check: Callable[[], T], share: Any = None) -> tuple[T | None, CheckpointError | None, list[Any]]:
    """``check()`` on this rank, then one gather of every rank's ``share`` and outcome: returns this
    rank's result, the first :class:`CheckpointError` in rank order (None when no rank failed; the
    same on every rank) and the shares in rank order. The caller decides what to raise first."""
    failure: CheckpointError | None = None
    views: list[Any] = []
    result = None
    try:
        result = check()
    except CheckpointError as e:
        failure = e
    try:
        views = gather_objects((share, failure))
        return result, next((f for _, f in views if f is not None), None), [v for v, _ in views]
    finally:
        # an exception's traceback holds this frame: break the cycle (see rank0_decides)
        failure, views = None, []


def _agreed(check: Callable[[], T]) -> T:
    """``check()`` on every rank; when it raises a :class:`CheckpointError` on any rank, every rank
    raises the first one (in rank order), so that none goes on alone into a collective or changes
    its state while another gives up."""
    result, failure, _ = _run_and_gather(check)
    if failure is not None:
        raise failure
    return result
