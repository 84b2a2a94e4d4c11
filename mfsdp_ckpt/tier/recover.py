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
4. every rank loads its node's copy (``load(..., same_path=False)``: the checksums of every
   chunk are checked again as it is read), into whatever layout the job has now.

When no step is whole, nothing is loaded and the caller falls back to its durable checkpoint:
:class:`Recovery` says why either way, in one line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.sharded.load import load
from mfsdp_ckpt.tier.files import Transfer, check_file, move_files
from mfsdp_ckpt.tier.layout import TIER_INDEX_NAME, MemoryTier, TierFile, read_tier_index, tier_index, tier_steps
from mfsdp_ckpt.write.agreement import Job
from mfsdp_core.collectives import gather_objects, rank_and_world

__all__ = ["Recovery", "recover", "survey_node"]


@dataclass
class Recovery:
    """What :func:`recover` did: the ``step`` loaded (None: none, see ``why``), this node's
    ``path`` to it, the ``extra`` values saved with it, the seconds the whole restore took, and
    ``why``: one line on the steps passed over (empty when the newest was whole)."""

    step: int | None
    path: str | None
    extra: dict[str, Any]
    seconds: float
    why: str


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


def _decide(surveys: dict[int, Survey]) -> _Decision:
    """The newest step whose every file some node holds whole (the same on every rank)."""
    why: list[str] = []
    for step in sorted({s for sv in surveys.values() for s in sv}, reverse=True):
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
) -> Recovery:
    """Load the newest whole snapshot of ``tier`` into ``model`` (and ``optimizer``); see the
    module docstring. ``not_before``: a step the caller can load from elsewhere (its durable
    checkpoint's): a whole snapshot older than it is not loaded (nothing is, and ``why`` says
    so). Loads with ``atomic=False`` (into a fresh model: one pass over the bytes). Every file was
    checked against its crc32c first, so a chunk failing its own check in the load means the
    tier changed meanwhile: the load's error is raised, and the model, partly loaded, must not
    be trained on."""
    started = time.perf_counter()
    rank, world = rank_and_world()
    node, nodes = tier.node_of(rank), tier.nodes(world)
    leader = rank == tier.leader(node)
    mine = survey_node(tier, node) if leader else None
    surveys = {tier.node_of(r): s for r, s in enumerate(gather_objects(mine)) if s is not None}
    checked: set[int] = set()
    while (decision := _decide(surveys)).step is not None and decision.step not in checked:
        if not_before is not None and decision.step < not_before:
            break  # older than what the caller has: not worth checking
        checked.add(decision.step)  # its copies' crc32c, then the decision again
        mine = survey_node(tier, node, [decision.step], checksum=True) if leader else None
        for r, s in enumerate(gather_objects(mine)):
            if s is not None and decision.step in s:
                surveys[tier.node_of(r)][decision.step] = s[decision.step]
    why = "; ".join(decision.why)
    if decision.step is None:
        reason = why or f"no snapshot in {tier.run_dir}"
        return Recovery(None, None, {}, time.perf_counter() - started, reason)
    if not_before is not None and decision.step < not_before:
        older = f"its newest whole snapshot, step {decision.step}, is older than step {not_before}"
        return Recovery(None, None, {}, time.perf_counter() - started, "; ".join([*decision.why, older]))
    step = decision.step
    job = Job.current(same_error=True)
    what = f"memory tier step {step}: not recovered"
    job.run(what, move_files, _assembly(tier, decision, nodes), decision.files, rank)
    job.run(what, _complete_index if leader else _nothing, tier, node, step, decision)
    path = tier.step_dir(node, step)
    extra = load(path, model, optimizer, atomic=False, same_path=False)
    return Recovery(step, path, extra, time.perf_counter() - started, why)


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
        with open(path + ".partial", "w") as f:
            json.dump(tier_index(step, decision.nodes, decision.files), f)
        os.replace(path + ".partial", path)


def _nothing(*_: Any) -> None:
    """A rank's share of a phase only the node leaders act in."""
