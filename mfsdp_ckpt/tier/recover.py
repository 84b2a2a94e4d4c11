"""``recover``: load the newest snapshot that the memory tier holds whole, from wherever its
files survive.

Collective over the default group, at any world size. In order:

1. each node's leader surveys its node's snapshots: ``tier.json`` read and checked, and every
   file it lists found with its recorded size (a truncated or missing file is noted with why);
2. every rank sees every survey (one all-gather) and takes the same decision: the newest step
   whose every file has a copy on some node (its own or a peer's replica), the ``tier.json`` of
   its copies agreeing; then each leader checks its copies of that step's files against their
   crc32c (a flipped byte), every rank sees the results, and the decision is taken again with
   them, until a step is whole where it is checked or none is left; for each newer step, why not;
3. each node gets the files it lacks from a node that has them whole (checked on arrival), so
   that its step directory is a complete checkpoint;
4. the caller's ``check`` of the step (its manifest: this run's identity and settings) and the
   step its manifest records (a directory renamed to another step is not that step);
5. every rank loads its node's copy (``load(..., same_path=False)``: the checksums of every
   chunk are checked again as it is read), into whatever layout the job has now.

A step that fails 3 or 4 is passed over, and the next whole one is tried; one whose load fails
ends the call with ``touched`` set (the model is partly loaded): the caller rebuilds its model
and calls again with that step in ``passed_over``. When no step is whole, nothing is loaded and
the caller falls back to its durable checkpoint: :class:`Recovery` says why either way, in one
line. A node whose directory is no directory of the tier (a link: never read or written
through) recovers nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mfsdp_ckpt.errors import CheckpointError, JobLostError
from mfsdp_ckpt.sharded.load import PARTLY_LOADED, load
from mfsdp_ckpt.tier.entries import ensure_dir, write_new
from mfsdp_ckpt.tier.files import Transfer, check_file, move_files, target_dirs
from mfsdp_ckpt.tier.layout import (
    TIER_INDEX_NAME,
    MemoryTier,
    TierFile,
    read_tier_index,
    recorded_step_problem,
    tier_index,
    tier_steps,
)
from mfsdp_ckpt.write.agreement import Job
from mfsdp_core.collectives import gather_objects, rank_and_world

__all__ = ["Recovery", "recover", "survey_node"]


@dataclass
class Recovery:
    """What :func:`recover` did: the ``step`` loaded (None: none, see ``why``), this node's
    ``path`` to it, the ``extra`` values saved with it, the seconds the whole restore took, and
    ``why``: one line on the steps passed over (empty when the newest was whole). ``touched``:
    the load of ``failed_step`` failed part-way (``why`` says how), so the model and optimizer
    hold part of it and must be rebuilt before anything else is loaded into them."""

    step: int | None
    path: str | None
    extra: dict[str, Any]
    seconds: float
    why: str
    touched: bool = False
    failed_step: int | None = None


#: the caller's check of a whole step before it is loaded: this node's copy of it -> why it is
#: not to be loaded (None: load it); the same answer on every rank (rank 0 decides for all)
Check = Callable[[str], "str | None"]

#: a node's survey: step -> (its tier.json as (nodes, files), or None; file -> why unusable, or None)
Survey = dict[int, tuple[tuple[int, dict[str, TierFile]] | None, dict[str, str | None], str | None]]


def survey_node(tier: MemoryTier, node: int, steps: list[int] | None = None, checksum: bool = False) -> Survey:
    """The committed snapshots in ``node``'s directory (``steps``: those only): its ``tier.json``
    and, for each file it lists, why this node's copy cannot be used (None: it has the recorded
    size, and with ``checksum`` the recorded crc32c)."""
    out: Survey = {}
    for step in tier_steps(tier.node_dir(node)):
        if steps is not None and step not in steps:
            continue
        directory = tier.step_dir(node, step)
        try:
            recorded_step, nodes, files = read_tier_index(directory)
        except CheckpointError as e:
            out[step] = (None, {}, str(e))
            continue
        if recorded_step != step:
            out[step] = (None, {}, f"{directory}: {TIER_INDEX_NAME} names step {recorded_step}")
            continue
        problems = {name: check_file(directory, name, f, checksum) for name, f in files.items()}
        out[step] = ((nodes, files), problems, None)
    return out


@dataclass(frozen=True)
class _Decision:
    step: int | None
    files: dict[str, TierFile]
    nodes: int
    holders: dict[str, list[int]]  # file -> the nodes holding it whole
    why: list[str]


def _decide(surveys: dict[int, Survey], passed_over: Mapping[int, str] = {}) -> _Decision:
    """The newest step whose every file some node holds whole, and not ``passed_over`` (step ->
    why; the same on every rank)."""
    why: list[str] = []
    for step in sorted({s for sv in surveys.values() for s in sv} | set(passed_over), reverse=True):
        if step in passed_over:
            why.append(f"step {step}: {passed_over[step]}")
            continue
        indexes = {node: sv[step] for node, sv in surveys.items() if step in sv}
        usable = {node: entry for node, entry in indexes.items() if entry[0] is not None}
        if not usable:
            why.append(f"step {step}: {next(e[2] for e in indexes.values() if e[2])}")
            continue
        first = next(iter(usable.values()))[0]
        assert first is not None
        if any(entry[0] != first for entry in usable.values()):
            why.append(f"step {step}: the nodes' {TIER_INDEX_NAME} differ")
            continue
        nodes, files = first
        holders = {name: [n for n, e in usable.items() if e[1].get(name) is None] for name in files}
        lost = sorted(name for name, held in holders.items() if not held)
        if lost:
            problems = ", ".join(f"node{n} {e[1][lost[0]]}" for n, e in sorted(usable.items()))
            more = f" (and {len(lost) - 1} more files)" if len(lost) > 1 else ""
            why.append(f"step {step}: no whole copy of {lost[0]} ({problems}){more}")
            continue
        return _Decision(step, files, nodes, holders, why)
    return _Decision(None, {}, 0, {}, why)


def recover(
    tier: MemoryTier,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    not_before: int | None = None,
    check: Check | None = None,
    passed_over: Mapping[int, str] = {},
) -> Recovery:
    """Load the newest whole snapshot of ``tier`` into ``model`` (and ``optimizer``); see the
    module docstring. ``not_before``: a step the caller can load from elsewhere (its durable
    checkpoint's): a whole snapshot older than it is not loaded (nothing is, and ``why`` says
    so). ``check``: the caller's look at a whole step before it is loaded (a step it refuses is
    passed over, saying why). ``passed_over``: steps not to take (step -> why: a load that failed
    in an earlier call). Loads with ``atomic=False`` (into a fresh model: one pass over the bytes);
    a load that fails returns ``touched`` (see :class:`Recovery`)."""
    started = time.perf_counter()
    rank, world = rank_and_world()
    node, nodes = tier.node_of(rank), tier.nodes(world)
    leader = rank == tier.leader(node)
    problem = tier.node_problem(node) if leader else None
    mine = (survey_node(tier, node) if leader and problem is None else None, problem)
    gathered = gather_objects(mine)
    refused = sorted({p for _, p in gathered if p})
    if refused:  # a node with no directory of its own to assemble and load from: nothing recovered
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return Recovery(None, None, {}, time.perf_counter() - started, refused[0] + more)
    surveys = {tier.node_of(r): s for r, (s, _) in enumerate(gathered) if s is not None}
    passed = dict(passed_over)
    checked: set[int] = set()
    while (decision := _decide(surveys, passed)).step is not None:
        step = decision.step
        if not_before is not None and step < not_before:
            break  # older than what the caller has: not worth checking
        if step not in checked:  # its copies' crc32c, then the decision again
            checked.add(step)
            mine_crc = survey_node(tier, node, [step], checksum=True) if leader else None
            for r, s in enumerate(gather_objects(mine_crc)):
                if s is not None and step in s:
                    surveys[tier.node_of(r)][step] = s[step]
            continue
        failure = _assemble(tier, decision, nodes, node, leader, rank)
        path = tier.step_dir(node, step)
        if failure is None and check is not None:
            failure = check(path)
        if failure is not None:
            passed[step] = failure
            continue
        why = "; ".join(decision.why)
        try:
            extra = load(path, model, optimizer, atomic=False, same_path=False)
        except JobLostError:
            raise
        except CheckpointError as e:  # the same on every rank (a load agrees on its failures)
            seconds = time.perf_counter() - started
            return Recovery(
                None,
                None,
                {},
                seconds,
                f"its load failed: {str(e).removesuffix('; ' + PARTLY_LOADED)}",
                touched=True,
                failed_step=step,
            )
        return Recovery(step, path, extra, time.perf_counter() - started, why)
    why = "; ".join(decision.why)
    if decision.step is None:
        return Recovery(None, None, {}, time.perf_counter() - started, why or f"no snapshot in {tier.run_dir}")
    older = f"its newest whole snapshot, step {decision.step}, is older than step {not_before}"
    return Recovery(None, None, {}, time.perf_counter() - started, "; ".join([*decision.why, older]))


def _assemble(tier: MemoryTier, decision: _Decision, nodes: int, node: int, leader: bool, rank: int) -> str | None:
    """Every node's copy of the chosen step made whole (the files it lacks received, checked on
    arrival, into real directories of the tier only), and the step its manifest records checked;
    why not, in one line (the same on every rank), or None."""
    assert decision.step is not None
    step = decision.step
    job = Job.current(same_error=True)
    what = f"memory tier step {step}: not recovered"
    transfers = _assembly(tier, decision, nodes)
    try:
        job.run(what, _open_step_dir if leader else _nothing, tier, node, step)
        job.run(what, target_dirs, transfers, rank)
        job.run(what, move_files, transfers, decision.files, rank)
        job.run(what, _complete_index if leader else _nothing, tier, node, step, decision)
        job.run(what, _recorded_step if leader else _nothing, tier, node, step)
    except JobLostError:
        raise
    except CheckpointError as e:
        return str(e)
    return None


def _open_step_dir(tier: MemoryTier, node: int, step: int) -> None:
    """A leader: its node's directory of ``step`` as a real directory of the tier (created when
    the node holds none; a link there is refused, never written through)."""
    ensure_dir(tier.step_dir(node, step), tier.root)


def _recorded_step(tier: MemoryTier, node: int, step: int) -> None:
    """A leader: the assembled step's ``tier.json`` and manifest record ``step`` (a directory
    relabelled with another step's name is not that step)."""
    problem = recorded_step_problem(tier.step_dir(node, step), step)
    if problem is not None:
        raise CheckpointError(problem)


def _assembly(tier: MemoryTier, decision: _Decision, nodes: int) -> list[Transfer]:
    """For every node of the job now, the files of the chosen step it lacks, each from the first
    node that holds it whole."""
    assert decision.step is not None
    out = []
    for node in range(nodes):
        for name in sorted(decision.files):
            held = decision.holders[name]
            if node in held:
                continue
            source = held[0]
            out.append(
                Transfer(
                    name,
                    tier.leader(source),
                    tier.leader(node),
                    tier.step_dir(source, decision.step),
                    tier.step_dir(node, decision.step),
                )
            )
    return out


def _complete_index(tier: MemoryTier, node: int, step: int, decision: _Decision) -> None:
    """A leader whose node had no whole ``tier.json`` of the step writes it (its files are all there now)."""
    path = os.path.join(tier.step_dir(node, step), TIER_INDEX_NAME)
    try:
        whole = read_tier_index(os.path.dirname(path))[2] == decision.files
    except CheckpointError:
        whole = False
    if not whole:
        write_new(path + ".partial", json.dumps(tier_index(step, decision.nodes, decision.files)).encode())
        os.replace(path + ".partial", path)


def _nothing(*_: Any) -> None:
    """A rank's share of a phase only the node leaders act in."""
