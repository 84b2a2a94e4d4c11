"""``load``: collective over the ranks of a ``fully_shard``-ed model, from a checkpoint written at
any layout (docs/checkpoint.md, "How a load flows through the modules").

A load runs in four steps, each its own function: plan (what this rank reads and where it goes:
views of the live state), agree before reading (every rank's key, shape and coverage problems and
the soundness of every entry to read, one gather), read and check (each rank reads and verifies
its own chunks; the ranks agree once on any failure), and apply (copy into place). Nothing in
the model or optimizer changes before the last step.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from mfsdp_ckpt.errors import CorruptCheckpointError, StateMismatchError, raise_key_problems
from mfsdp_ckpt.format.keys import (
    MAIN_PARAM,
    PARAM_GROUPS,
    extra_name,
    fqn_of_model_key,
    grad_key,
    model_key,
    optim_key,
    rng_key,
)
from mfsdp_ckpt.model.experts import expert_count_problem, expert_counts
from mfsdp_ckpt.read.chunks import ChunkFiles, coverage_faults
from mfsdp_ckpt.read.dcp_reader import VerifyingReader
from mfsdp_ckpt.read.indexed import derived, narrowed
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.read.manifest import is_committed, read_manifest
from mfsdp_ckpt.read.metadata_check import entry_faults
from mfsdp_ckpt.read.staged_read import DEFAULT_READ_THREADS
from mfsdp_ckpt.read.stock import KeyRule, missing_summary, parse_key_map, stock_param_groups
from mfsdp_ckpt.sharded.mx_load import MXTarget, check_planes, mx_targets, write_planes
from mfsdp_ckpt.sharded.planner import MfsdpLoadPlanner
from mfsdp_ckpt.sharded.state import FlatEntry, load_targets, param_group_updates
from mfsdp_ckpt.write.agreement import agreed, dcp_failure, run_and_gather
from mfsdp_core import describe_shards, plan_of, refresh_compute_params
from mfsdp_core.collectives import gather_objects, rank0_decides, rank_and_world
from mfsdp_core.optim import optimizer_buffers

__all__ = ["load", "PARTLY_LOADED"]

PARTLY_LOADED = "load(atomic=False): the model and optimizer are partly loaded"


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
    atomic: bool = True,
    same_path: bool = True,
    fresh: Collection[str] = (),
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), whatever layout wrote it. Collective:
    the ranks agree on every refusal, so all raise the same error. Checksums are verified for
    every chunk read; shapes must always match.

    Args:
        path: a checkpoint, a run directory or its ``latest`` (resolved once, by rank 0), or an
            fsspec URL (``s3://…``): each rank reads the byte ranges of the chunks it needs, with
            the client's retries.
        model: the ``fully_shard``-ed model; a checkpoint with another number of experts is
            refused first.
        optimizer: its ``fully_shard_optimizer``-adapted optimizer, or None. A fresh one first
            gets its state created by a learning-rate-0 step, which leaves the parameters as they are.
        strict: every model (and optimizer) key must be in the checkpoint and vice versa, all
            mismatches named in one error (a key is unexpected only when no rank wants it: under
            expert parallelism each wants its own experts). With ``False`` the keys not found are
            reported, by group, in one ``UserWarning`` (the same on every rank), which says so
            when no optimizer state was loaded.
        require_manifest: ``False`` admits a stock DCP checkpoint (no ``mfsdp.json``, so no checksums).
        restore_rng: restore each rank's torch RNG state when the checkpoint was written at the
            same world size.
        thread_count: reader threads per rank (see :mod:`mfsdp_ckpt.read.staged_read`).
        key_map: ``OLD=NEW`` prefix renames of a stock checkpoint's keys, which are read in
            canonical form (FSDP2's ``get_state_dict`` layout: ``optim.state.<fqn>.<state>``,
            ``optim.param_groups.<…>.<hp>``; torchtitan's needs none): ``['=model.']`` for bare
            model names alone (:mod:`mfsdp_ckpt.read.stock`; see also ``load_with_state_dict_hooks``).
        atomic: nothing in the model or optimizer changes unless the whole load succeeds (every
            rank reads and verifies all its chunks before any is copied into place). ``False`` is
            for a model with nothing to protect (freshly initialised, as when a trainer resumes):
            the bytes are read straight into place and checked as they arrive, one pass instead of
            two (:mod:`mfsdp_ckpt.read.direct_read`); every check before reading is the same, and a
            bad chunk is still an error, the same on every rank, ending in ``load(atomic=False):
            the model and optimizer are partly loaded``: that state must not be trained on.
        same_path: ``path`` names one checkpoint for every rank (rank 0 resolves it for all).
            ``False``: each rank names its own copy of the same checkpoint (a node's memory
            tier, :mod:`mfsdp_ckpt.tier`) and resolves it itself.
        fresh: model keys it need not hold (kept as they are; a LoRA run's fresh adapters).

    Returns:
        The ``extra`` values saved with the checkpoint.
    """
    rules = parse_key_map(key_map)
    # one answer for all ranks, even if ``latest`` moves while they start
    directory = rank0_decides(resolve_checkpoint, path) if same_path else agreed(lambda: resolve_checkpoint(path))
    manifest = read_manifest(directory) if require_manifest or is_committed(directory) else None
    reader = VerifyingReader(
        directory, manifest, thread_count=thread_count, canonical=True, key_map=rules, direct=not atomic
    )
    try:
        saved = reader.read_metadata().state_dict_metadata  # read once; dcp.load is handed the same object
        _check_expert_count(model, saved, directory)
        if optimizer is not None:
            optimizer_buffers(optimizer)  # raises if it was not adapted by fully_shard_optimizer
            _ensure_optimizer_state(optimizer)
        plan = _plan_load(model, optimizer, saved, reader.group_parts, manifest, restore_rng)
        _agree_before_reading(plan, reader, saved, directory, strict, optimizer is not None, frozenset(fresh))
        _add_whole_entries(plan, saved)
        planner = MfsdpLoadPlanner()
        try:
            updates = agreed(lambda: _read_and_check(plan, reader, planner, optimizer, saved, rules, directory))
        except CorruptCheckpointError as e:
            if atomic:
                raise
            raise CorruptCheckpointError(f"{e}; {PARTLY_LOADED}") from None
        return _apply(plan, reader, planner, model, optimizer, updates)
    finally:
        reader.close()  # the data files a load keeps open between reading and copying


@dataclass
class _LoadPlan:
    """What this rank reads and where each entry goes, decided before any byte is read."""

    shards: list
    targets: dict[str, Any]  # key -> destination (a FlatEntry, a tensor, None for an object)
    scalar_objects: list[tuple[str, tuple[dict, str]]]  # optimizer scalars: key -> (state, name)
    found: _KeyProblems
    mx: list[MXTarget]
    main_entries: dict[str, FlatEntry]  # the main params of MX parameters, to check planes against
    extra_keys: list[str]
    rng_key: str | None  # this rank's RNG entry, when it is restored
    group_keys: list[str]  # the entries making the optimizer's groups; empty when none are loaded


def _plan_load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    saved: dict[str, Any],
    group_parts: list[str],
    manifest: dict[str, Any] | None,
    restore_rng: bool,
) -> _LoadPlan:
    """This rank's plan: its shards' destinations, MX planes, the extras, its RNG state (restored
    only when the checkpoint was written at this world size) and the optimizer's groups."""
    rank, world = rank_and_world()
    shards = describe_shards(model, optimizer)
    targets, scalar_objects, found = _plan_targets(load_targets(shards, optimizer), saved)
    mx, mx_problems = mx_targets(shards, saved)
    found.shape_errors.extend(mx_problems)
    found.claimed.update(group_parts)
    main_entries = {t.main_key: targets[t.main_key] for t in mx if t.main_key in targets}
    for t in mx:
        targets.update(t.planes.values())
    writer_world = ((manifest or {}).get("writer") or {}).get("world_size")
    mine = rng_key(rank)
    restore = restore_rng and writer_world == world and mine in saved
    group_keys: list[str] = []
    if optimizer is not None:
        group_keys = [PARAM_GROUPS] if PARAM_GROUPS in saved else list(group_parts)
    return _LoadPlan(
        shards=shards,
        targets=targets,
        scalar_objects=scalar_objects,
        found=found,
        mx=mx,
        main_entries=main_entries,
        extra_keys=[key for key in saved if extra_name(key) is not None],
        rng_key=mine if restore else None,
        group_keys=group_keys,
    )


def _agree_before_reading(
    plan: _LoadPlan,
    reader: VerifyingReader,
    saved: dict[str, Any],
    directory: str,
    strict: bool,
    with_optimizer: bool,
    fresh: frozenset[str] = frozenset(),
) -> None:
    """One gather for both: the key problems of every rank (raised first, the same on all), then
    the first failure of the entry checks; with ``strict=False``, the warning of what was not
    found."""
    _, failure, views = run_and_gather(
        lambda: _check_before_reading(plan, reader, saved, directory), _key_view(plan.found, saved)
    )
    not_found = _agree_on_keys(views, saved, with_optimizer, strict, directory, fresh)
    if failure is not None:
        raise failure
    if not strict:
        loads_optimizer_state = any(k.startswith("optim.") and k != PARAM_GROUPS and k in plan.targets for k in saved)
        _report_not_found(not_found, with_optimizer and not loads_optimizer_state, directory)


def _check_before_reading(plan: _LoadPlan, reader: VerifyingReader, saved: dict[str, Any], directory: str) -> None:
    """Refuse, before anything is allocated: an RNG entry that is not a torch RNG state, groups
    stored as a tensor, and any entry to read that is not sound or whose bytes are absent."""
    if plan.rng_key is not None:
        md, state = saved[plan.rng_key], torch.get_rng_state()
        if not (
            isinstance(md, TensorStorageMetadata)
            and tuple(md.size) == tuple(state.shape)
            and md.properties.dtype == state.dtype
        ):
            raise CorruptCheckpointError(
                f"{directory}: key '{plan.rng_key}': not a {tuple(state.shape)} uint8 tensor (a torch RNG state)"
            )
    if plan.group_keys and not isinstance(saved.get(PARAM_GROUPS, BytesStorageMetadata()), BytesStorageMetadata):
        raise CorruptCheckpointError(
            f"{directory}: key '{PARAM_GROUPS}': stored as a tensor, expected the optimizer's groups"
        )
    keys = [*plan.targets, *plan.extra_keys, *([plan.rng_key] if plan.rng_key else []), *plan.group_keys]
    _check_entries(reader, saved, directory, keys, plan.found.covered, plan.targets)


def _add_whole_entries(plan: _LoadPlan, saved: dict[str, Any]) -> None:
    """Destinations of the entries read whole (extras, the RNG state, the optimizer's groups),
    allocated once every rank agreed that all of them are sound."""
    for key in plan.extra_keys:
        md = saved[key]
        plan.targets[key] = (
            None if isinstance(md, BytesStorageMetadata) else torch.empty(md.size, dtype=md.properties.dtype)
        )
    if plan.rng_key is not None:
        plan.targets[plan.rng_key] = torch.empty_like(torch.get_rng_state())
    plan.targets.update((key, None) for key in plan.group_keys)


def _read_and_check(
    plan: _LoadPlan,
    reader: VerifyingReader,
    planner: MfsdpLoadPlanner,
    optimizer: torch.optim.Optimizer | None,
    saved: dict[str, Any],
    rules: Sequence[KeyRule],
    directory: str,
) -> list[dict[str, Any]] | None:
    """Read and verify this rank's chunks, then check what was read (MX planes, the RNG state,
    the optimizer's groups); returns the groups' updates. Changes nothing live.

    Each rank plans and reads its own chunks (DCP's ``no_dist``: a load plan needs nothing from
    the other ranks, and central planning would cost two gathers and a scatter per load)."""
    rank, _ = rank_and_world()
    try:
        with warnings.catch_warnings():  # DCP's notice that no_dist reads "in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(plan.targets, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:
        raise dcp_failure(e, rank) from None
    check_planes(plan.mx, reader, plan.main_entries, directory)
    if plan.rng_key is not None:
        try:
            torch.Generator().set_state(reader.preview(plan.rng_key, plan.targets[plan.rng_key]))
        except (RuntimeError, ValueError, TypeError) as e:
            raise CorruptCheckpointError(
                f"{directory}: key '{plan.rng_key}': not a valid torch RNG state ({type(e).__name__})"
            ) from None
    if not plan.group_keys:
        return None
    if PARAM_GROUPS not in saved:  # a stock checkpoint's entries, one per (group, hyper-parameter)
        planner.objects[PARAM_GROUPS] = stock_param_groups(plan.group_keys, planner.objects.__getitem__, rules)
    _check_param_groups(planner.objects.get(PARAM_GROUPS), directory)
    return param_group_updates(plan.shards, optimizer, planner.objects[PARAM_GROUPS], directory)


def _apply(
    plan: _LoadPlan,
    reader: VerifyingReader,
    planner: MfsdpLoadPlanner,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    updates: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """Copy everything read into place (every rank has read and checked all it needs); returns
    the ``extra`` values."""
    if updates is not None:
        for group, update in zip(optimizer.param_groups, updates):
            group.update(update)
    with torch.no_grad():
        reader.apply(planner)
        for key, (state, name) in plan.scalar_objects:
            state[name] = planner.objects[key]
    refresh_compute_params(model)
    with torch.no_grad():
        if write_planes(plan.mx):  # planes that cannot be derived exactly: as saved
            refresh_compute_params(model, derive_companions=False)
    if plan.rng_key is not None:
        torch.set_rng_state(plan.targets[plan.rng_key])
    extras = {name: v for k, v in plan.targets.items() if (name := extra_name(k)) is not None}
    extras.update((name, v) for k, v in planner.objects.items() if (name := extra_name(k)) is not None)
    return extras


def _check_entries(
    reader: VerifyingReader,
    saved: dict[str, Any],
    directory: str,
    keys: list[str],
    covered: set[str],
    targets: dict[str, Any],
) -> None:
    """Refuse, before anything is allocated or read, an entry to load whose metadata is not sound
    (:func:`~mfsdp_ckpt.read.metadata_check.entry_faults`; coverage only where :func:`_plan_targets`
    did not check it) or whose chunks' files do not hold their byte ranges. A checkpoint read
    through its index is checked in the chunks this rank reads (its record tables are checked as
    they are read). Ranks reading the same chunks fail alike; :func:`_agree_before_reading`
    makes every rank raise the first failure."""
    problems = []
    stored_of: dict[str, list] = {}
    for key in sorted(set(keys)):
        md, target = saved[key], targets.get(key)
        whole = key not in covered and not derived(md)  # an index's chunks cover by construction
        if isinstance(target, FlatEntry) and derived(md):
            md, stored_of[key] = (
                narrowed(md, target.start, target.end),
                md.chunks.stored_within(target.start, target.end),
            )
        else:
            stored_of[key] = reader.stored.get(key, [])
        faults = entry_faults(key, md, stored_of[key], check_coverage=whole)
        if faults:
            problems.append(str(faults[0]))
    if problems:
        more = f" (and {len(problems) - 3} more entries)" if len(problems) > 3 else ""
        raise CorruptCheckpointError(f"{directory}: " + "; ".join(problems[:3]) + more)
    with ChunkFiles(directory, None) as files:
        for key in sorted(stored_of):
            files.require_present(stored_of[key])


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


def _check_param_groups(groups: Any, directory: str) -> None:
    """The saved optimizer groups have the shape ``param_group_updates`` reads: a list of dicts
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
    targets, saved: dict[str, Any]
) -> tuple[dict[str, Any], list[tuple[str, tuple[dict, str]]], _KeyProblems]:
    """The destination of every key to read (views of the live state), the non-tensor optimizer
    scalars to set afterwards, and this rank's key, shape and coverage problems (which
    :func:`_agree_on_keys` combines over the ranks), all before any byte is read."""
    plan: dict[str, Any] = {}
    scalar_objects: list[tuple[str, tuple[dict, str]]] = []
    missing, shape_errors, coverage_errors = [], [], []
    ours: set[str] = set()
    covered: set[str] = set()  # coverage checked here, not again by _check_entries

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
        if not derived(md) and coverage_faults(key, md):  # an index's chunks cover by construction
            coverage_errors.append(key)
            return
        covered.add(key)
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
    return plan, scalar_objects, _KeyProblems(missing, shape_errors, coverage_errors, ours, covered)


@dataclass
class _KeyProblems:
    """One rank's view of the keys: what it wants that the checkpoint lacks, shape and coverage
    problems, every key it claims (wanted, or stood in for by another), and the keys whose chunks
    were found to cover their tensor exactly."""

    missing: list[str]
    shape_errors: list[str]
    coverage_errors: list[str]
    claimed: set[str]
    covered: set[str]


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
    fresh: frozenset[str] = frozenset(),
) -> list[str]:
    """Raise the same :class:`StateMismatchError` on every rank, or none, from every rank's
    :func:`_key_view`. A checkpoint key is unexpected only when no rank claims it: under expert
    parallelism each rank wants only its own experts. Returns the keys some rank wants that the
    checkpoint lacks (an error when ``strict``), but those ``fresh`` allows."""
    keys = sorted(saved)
    anyone = [any(v[3][i] for v in views) for i in range(len(keys))]
    missing, unexpected = {k for v in views for k in v[0]} - fresh, []
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
