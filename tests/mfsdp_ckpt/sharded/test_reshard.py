"""Resharding: a checkpoint saved at world size A with (strategy, policy) X loads at world size B
with Y, for A, B in 1-4 and all X, Y; every loaded tensor is bitwise equal to the saved logical
tensor (assembled from the writer's owned pieces, each element exactly once). Grads
(``include_grads=True``) are saved and compared for the ``row`` writers.

The matrix is designed rather than exhaustive (4,096 loads, each into a freshly built model, took
276 s); together its parts check what the exhaustive one did:

- **the plan algebra of every combination, without ranks** (:func:`test_reshard_plan_algebra`):
  for every (A, X) and (B, Y), A and B in 1-5, the planning simulator
  (:mod:`mfsdp_ckpt.tools.plan_sim`) gives the chunks a save at (A, X) commits and each virtual
  rank's shards at (B, Y). The saved chunks cover every element of every tensor exactly once;
  each target rank wants every saved key that no other rank stands in for, with the saved shape
  (the load's own ``_plan_targets``); and the reads DCP plans for it
  (``create_read_items_for_chunk_list``, what our load planner calls) tile each of its boxes with
  no gap and no overlap, every read inside one saved chunk at the same place in the tensor;
- **the bytes, on ranks** (:func:`test_reshard_matrix`): every (X, Y) pair of writer and reader
  once (256), the world pair (A, B) rotating over all 16 pairs so that each gets 16 of them and
  every (A, X) checkpoint is read four times; plus all 16 world pairs for three configurations
  that stress the layouts most (:data:`ALL_WORLDS`). Each rank builds one model and optimizer per
  target (B, Y) and reloads it for every source assigned to it, poisoned with NaN before every
  reload after the first (and checked to be), so that an element the load does not write fails
  the bitwise comparison (NaN equals nothing).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections import Counter, defaultdict

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import mfsdp_ckpt
from mfsdp_ckpt.format.boxes import flat_range_to_boxes
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.sharded.load import _plan_targets
from mfsdp_ckpt.sharded.state import FlatEntry, load_targets
from mfsdp_ckpt.tools.plan_sim import prime_adamw_state, simulate
from mfsdp_core import describe_shards, fully_shard_optimizer
from tests.mfsdp_ckpt.util import assemble, build, owned_pieces, shapes_of, train_steps
from tests.mfsdp_core.models import make_adamw, make_model, shard_model

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
POLICIES = ["even", "row", "block(32)", "tensor"]
CONFIGS = list(itertools.product(STRATEGIES, POLICIES))
WORLD_SIZES = [1, 2, 3, 4]
WORLD_PAIRS = list(itertools.product(WORLD_SIZES, WORLD_SIZES))
#: (writer config, reader config) loaded at every one of the 16 world pairs: a flat even ZeRO-3
#: round trip (every element moves between ranks when A != B), row blocks cut into whole tensors
#: (a tensor policy puts each tensor on one rank, many ranks hold nothing of it), and a
#: replicated row writer with grads into flat even ZeRO-3.
ALL_WORLDS = [
    (("optim_grads_params", "even"), ("optim_grads_params", "even")),
    (("optim_grads", "block(32)"), ("optim_grads_params", "tensor")),
    (("no_shard", "row"), ("optim_grads_params", "even")),
]
STEPS = 2  # optimizer steps before the save: every loaded ``step`` must say so
SIM_WORLDS = [1, 2, 3, 4, 5]  # the plan algebra adds an odd world size the ranks do not run


def designed_loads() -> list[tuple[int, tuple[str, str], int, tuple[str, str]]]:
    """(A, X, B, Y) of every load the ranks run: writer config i and reader config j at world
    pair ``WORLD_PAIRS[(i + j) % 16]`` (a Latin square: for a fixed X the 16 readers meet all 16
    world pairs, so every (A, X) is read at every B; for a fixed Y likewise), then
    :data:`ALL_WORLDS` at every world pair. Sorted, without repeats."""
    loads = set()
    for i, x in enumerate(CONFIGS):
        for j, y in enumerate(CONFIGS):
            a, b = WORLD_PAIRS[(i + j) % len(WORLD_PAIRS)]
            loads.add((a, x, b, y))
    for x, y in ALL_WORLDS:
        loads.update((a, x, b, y) for a, b in WORLD_PAIRS)
    return sorted(loads)


def test_the_designed_matrix_covers_every_pair_and_every_checkpoint():
    loads = designed_loads()
    assert {(x, y) for _, x, _, y in loads} == set(itertools.product(CONFIGS, CONFIGS))  # all 256 (X, Y)
    latin = {(x, y): WORLD_PAIRS[(i + j) % 16] for i, x in enumerate(CONFIGS) for j, y in enumerate(CONFIGS)}
    assert Counter(latin.values()) == {pair: 16 for pair in WORLD_PAIRS}  # each (A, B) gets 16
    assert all((a, x, b, y) in loads for (x, y), (a, b) in latin.items())
    assert {(a, x) for a, x, _, _ in loads} == set(itertools.product(WORLD_SIZES, CONFIGS))  # all 64 read
    assert {(b, y) for _, _, b, y in loads} == set(itertools.product(WORLD_SIZES, CONFIGS))  # all 64 built
    for x, y in ALL_WORLDS:
        assert {(a, b) for a, xx, b, yy in loads if (xx, yy) == (x, y)} == set(WORLD_PAIRS)
    assert {x[0] for x, _ in ALL_WORLDS} | {y[0] for _, y in ALL_WORLDS} >= {"no_shard", "optim_grads_params"}
    assert len(loads) == 256 + len(ALL_WORLDS) * 16 - len(ALL_WORLDS)  # the rotation holds one of each


# ---- the bytes, on ranks ---------------------------------------------------------------------------


def _save_all(root: str, world: int) -> dict:
    out = {}
    for strategy, policy in CONFIGS:
        model, optim = build(strategy, policy)
        grads = policy == "row"
        # two steps, then a backward without zero_grad: grads are mid-accumulation at save time
        train_steps(model, optim, 0, STEPS, zero_grad_last=False)
        mfsdp_ckpt.save(os.path.join(root, f"w{world}-{strategy}-{policy}"), model, optim, include_grads=grads)
        out[(strategy, policy)] = owned_pieces(model, optim, grads=grads)
    return out


def _poison(model, optim) -> None:
    """Every element a load writes (compute weights, main params, optimizer state and step,
    grads) set to NaN."""
    nan = float("nan")
    with torch.no_grad():
        for ps in describe_shards(model, optim):
            for shard in (ps.param, ps.main, ps.grad, *ps.optim.values()):
                if shard is not None:
                    shard.tensor.fill_(nan)
            for value in ps.optim_extra.values():
                if isinstance(value, torch.Tensor):
                    value.fill_(nan)


def _steps(model, optim) -> list[float]:
    return [float(v) for ps in describe_shards(model, optim) for v in ps.optim_extra.values()]


def _load_designed(root: str, truth: dict, loads: list) -> tuple[list[str], int, int]:
    """This rank's part of every load at this world size: one model per reader config, reloaded
    for each of its sources. Returns (mismatches, loads made, tensors compared)."""
    failures: list[str] = []
    made = compared = 0
    sources: dict[tuple[str, str], list[tuple[int, tuple[str, str]]]] = defaultdict(list)
    for a, x, y in loads:
        sources[y].append((a, x))
    for (strategy, policy), writers in sources.items():
        model, optim = build(strategy, policy, seed=99)
        for n, (world, (x_strategy, x_policy)) in enumerate(writers):
            expected = truth[(world, x_strategy, x_policy)]
            grads = any(k.startswith("grad.") for k in expected)
            if n:  # a reload: nothing the previous load left may pass for this one
                _poison(model, optim)
                stale = owned_pieces(model, optim, grads=grads)
                assert all(bool(v.isnan().all()) for _, _, v in stale.values()), "poisoning missed an element"
                assert all(math.isnan(s) for s in _steps(model, optim))
            path = os.path.join(root, f"w{world}-{x_strategy}-{x_policy}")
            mfsdp_ckpt.load(path, model, optim)
            made += 1
            got = owned_pieces(model, optim, grads=grads)
            assert set(got) == set(expected), (path, set(got) ^ set(expected))
            for key, (lo, hi, values) in got.items():
                want = expected[key].reshape(-1)[lo:hi]
                compared += 1
                if not torch.equal(values, want):
                    failures.append(
                        f"A={world} {x_strategy}/{x_policy} -> {strategy}/{policy}: {key}[{lo}:{hi}] differs"
                    )
            if _steps(model, optim) != [float(STEPS)] * len(_steps(model, optim)):
                failures.append(f"A={world} {x_strategy}/{x_policy} -> {strategy}/{policy}: optimizer step not {STEPS}")
    return failures, made, compared


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints for every (A, X) and their logical tensors."""
    from tests.harness import run_ranks

    root = str(tmp_path_factory.mktemp("reshard"))
    shapes = shapes_of()
    truth = {}
    for world in WORLD_SIZES:
        per_rank = run_ranks(_save_all, world, root, world, timeout=600)
        for cfg in CONFIGS:
            truth[(world, *cfg)] = assemble([r[cfg] for r in per_rank], shapes)
    return root, truth


@pytest.mark.heavy
@pytest.mark.parametrize("target_world", WORLD_SIZES)
def test_reshard_matrix(ranks, saved, target_world):
    root, truth = saved
    loads = [(a, x, y) for a, x, b, y in designed_loads() if b == target_world]
    needed = {(a, *x): truth[(a, *x)] for a, x, _ in loads}
    per_rank = ranks(_load_designed, target_world, root, needed, loads, timeout=600)
    failures = [f for r in per_rank for f in r[0]]
    assert not failures, f"{len(failures)} mismatches, e.g.\n" + "\n".join(failures[:20])
    assert all(made == len(loads) for _, made, _ in per_rank), ([made for _, made, _ in per_rank], len(loads))
    assert all(compared > 0 for _, _, compared in per_rank)


# ---- the plan algebra of every combination, without ranks -----------------------------------------


def _meta_build(strategy: str, policy: str):
    """The test transformer on the meta device, sharded as on a rank, with an optimizer holding
    AdamW's state (for the simulator's virtual ranks)."""

    def build_rank(rank: int):
        with torch.device("meta"):
            model = make_model("transformer")
        model = shard_model(model, strategy=strategy, policy=policy)
        optim = fully_shard_optimizer(make_adamw(model.parameters()))
        prime_adamw_state(optim)
        return model, optim

    return build_rank


def _chunks(md: TensorStorageMetadata) -> tuple:
    return tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


def _counts(size: tuple[int, ...], regions) -> torch.Tensor:
    """How many times each element of a tensor of ``size`` lies in the (offsets, sizes) regions."""
    count = torch.zeros(size, dtype=torch.int32)
    for offsets, sizes in regions:
        view = count
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            view = view.narrow(dim, o, s)
        view += 1
    return count.reshape(-1)


@functools.lru_cache(maxsize=None)
def _coverage_problem(size: tuple[int, ...], chunks: tuple) -> str | None:
    """Why the saved chunks do not cover a tensor of ``size`` exactly once, or None."""
    if any(o < 0 or o + s > d for offsets, sizes in chunks for o, s, d in zip(offsets, sizes, size)):
        return f"a chunk lies outside the tensor {list(size)}"
    count = _counts(size, chunks)
    if not bool((count == 1).all()):
        return f"elements covered {int(count.min())}..{int(count.max())} times"
    return None


@functools.lru_cache(maxsize=None)
def _read_problem(size: tuple[int, ...], chunks: tuple, lo: int, hi: int, whole: bool) -> str | None:
    """Why the reads DCP plans for elements ``[lo, hi)`` (as the load's boxes of them, or the
    whole tensor) from the saved chunks do not tile them exactly once, or None."""
    boxes = (
        [(tuple([0] * len(size)), size)] if whole else [(b.offsets, b.sizes) for b in flat_range_to_boxes(size, lo, hi)]
    )
    md = TensorStorageMetadata(
        properties=None,  # type: ignore[arg-type] - the planning reads only sizes and chunks
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    wanted = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    stored = dict(chunks)
    regions = []
    for item in create_read_items_for_chunk_list("t", md, wanted):
        box_offsets, box_sizes = boxes[item.dest_index.index]
        source = tuple(item.storage_index.offset)
        if source not in stored:
            return f"a read from a chunk at {list(source)} that was not saved"
        lengths = tuple(item.lengths)
        at = tuple(o + d for o, d in zip(box_offsets, item.dest_offsets))
        if at != tuple(o + s for o, s in zip(source, item.storage_offsets)):
            return f"a read lands at {list(at)}, elsewhere than it was saved"
        if any(d + n > s for d, n, s in zip(item.dest_offsets, lengths, box_sizes)):
            return "a read overruns its target box"
        if any(d + n > s for d, n, s in zip(item.storage_offsets, lengths, stored[source])):
            return "a read overruns its saved chunk"
        regions.append((at, lengths))
    count = _counts(size, regions)
    if whole:
        lo, hi = 0, count.numel()
    if not bool((count[lo:hi] == 1).all()):
        return f"elements [{lo}, {hi}) read {int(count[lo:hi].min())}..{int(count[lo:hi].max())} times"
    if bool(count[:lo].any()) or bool(count[hi:].any()):
        return f"reads outside the elements [{lo}, {hi}) the rank owns"
    return None


@pytest.fixture(scope="module")
def layouts():
    """(W, X) -> (what a save at world W with config X commits: its ``.metadata`` entries; every
    virtual rank's (shards, optimizer)), for W in :data:`SIM_WORLDS`."""
    out = {}
    for world in SIM_WORLDS:
        for cfg in CONFIGS:
            sim = simulate(world, _meta_build(*cfg), include_grads=cfg[1] == "row")
            metadata, _ = sim.commit()
            out[(world, cfg)] = (metadata.state_dict_metadata, [(vr.shards, vr.optimizer) for vr in sim.ranks])
    return out


def _targets_problems(saved: dict, ranks: list, owners: dict) -> tuple[list[str], int]:
    """The load's planning on every target rank against ``saved``: its key, shape and coverage
    problems, each of its reads (see :func:`_read_problem`); every saved key claimed by a rank.
    Returns (problems, reads checked)."""
    problems: list[str] = []
    checked = 0
    claimed: set[str] = set()
    signature = frozenset(
        (k, tuple(md.size) if isinstance(md, TensorStorageMetadata) else None) for k, md in saved.items()
    )
    for r, (shards, optimizer) in enumerate(ranks):
        cache_key = (id(shards), signature)
        if cache_key not in owners:  # the plan depends on the saved keys and shapes alone (coverage: checked apart)
            owners[cache_key] = _plan_targets(load_targets(shards, optimizer), saved)
        plan, _, found = owners[cache_key]
        for what in ("missing", "shape_errors", "coverage_errors"):
            if getattr(found, what):
                problems.append(f"rank {r}: {what} {getattr(found, what)[:3]}")
        claimed |= found.claimed
        for key, target in plan.items():
            md = saved[key]
            if isinstance(target, FlatEntry):
                problem = _read_problem(tuple(md.size), _chunks(md), target.start, target.end, False)
            elif isinstance(target, torch.Tensor):
                problem = _read_problem(tuple(md.size), _chunks(md), 0, 0, True)
            else:
                continue  # an object (read whole by DCP)
            checked += 1
            if problem:
                problems.append(f"rank {r}: {key}: {problem}")
    unclaimed = sorted(set(saved) - claimed - {PARAM_GROUPS})
    if unclaimed:
        problems.append(f"saved keys no rank loads: {unclaimed[:3]}")
    return problems, checked


@pytest.mark.parametrize("writer_world", SIM_WORLDS)
def test_reshard_plan_algebra(layouts, writer_world):
    """Every (A, X) into every (B, Y), A = ``writer_world``, B in 1-5: see the module docstring."""
    problems: list[str] = []
    combinations = reads = 0
    owners: dict = {}
    for x in CONFIGS:
        saved, _ = layouts[(writer_world, x)]
        for key, md in saved.items():
            if isinstance(md, TensorStorageMetadata):
                problem = _coverage_problem(tuple(md.size), _chunks(md))
                if problem:
                    problems.append(f"A={writer_world} {x}: saved {key}: {problem}")
        assert any(k.startswith("grad.") for k in saved) == (x[1] == "row")
        for (b, y), (_, ranks) in layouts.items():
            found, checked = _targets_problems(saved, ranks, owners)
            problems += [f"A={writer_world} {x} -> B={b} {y}: {p}" for p in found]
            combinations += 1
            reads += checked
    assert not problems, f"{len(problems)} problems, e.g.\n" + "\n".join(problems[:20])
    assert combinations == len(CONFIGS) * len(CONFIGS) * len(SIM_WORLDS)
    assert reads >= combinations * 50  # every target rank plans reads of every state of every parameter


def test_the_plan_algebra_catches_a_gap_and_an_overlap():
    """The checks above can fail: a chunk missing, a chunk twice, a read of one element too few."""
    size = (4, 3)
    rows = (((0, 0), (2, 3)), ((2, 0), (2, 3)))
    assert _coverage_problem(size, rows) is None
    assert "covered 0..1 times" in _coverage_problem(size, rows[:1])
    assert "covered 1..2 times" in _coverage_problem(size, rows + (((1, 0), (1, 3)),))
    assert _read_problem(size, rows, 2, 11, False) is None
    assert "read 0..1 times" in _read_problem(size, rows[:1], 2, 11, False)
    assert _read_problem(size, rows, 0, 0, True) is None
