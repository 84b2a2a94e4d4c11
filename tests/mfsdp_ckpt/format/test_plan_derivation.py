"""The save plan every rank derives alone equals what gathering every rank's local plan gives.

For W virtual ranks in one process (:mod:`mfsdp_ckpt.tools.plan_sim`: the real ``fully_shard``
on the meta device inside PyTorch's fake process group, the real planner on each rank's shards),
for every strategy and policy, HSDP / HFSDP, expert parallelism and MXFP8 planes: the metadata
our coordinator commits from each rank's derived chunks equals DCP's from every rank's full
local plan (keys, dtypes, shapes, chunks), and every chunk a rank writes is one it holds. A rank
whose layout differs is named, with the first parameter that differs."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings

import pytest
import torch

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.catalog import Catalog, plan_of_placed
from mfsdp_ckpt.tools.plan_sim import prime_adamw_state, same_plan_as_dcp, simulate
from mfsdp_core import Placement, fully_shard, fully_shard_optimizer
from mfsdp_core.expert_parallel import expert_placement, init_expert_mesh
from mfsdp_core.hsdp import hsdp_groups, hsdp_placement
from mfsdp_core.models.gpt import GPTModel, get_preset, linear_weights, shard_experts, shard_units
from mfsdp_core.plan import mx_placement
from tests.mfsdp_core.models import make_adamw, make_model, shard_model

warnings.filterwarnings("ignore", message=".*native MXFP8 cast unavailable.*")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
POLICIES = ("even", "row", "tensor")
MOE = dataclasses.replace(get_preset("tiny-moe"), num_experts=12, moe_ffn_hidden_size=32, seq_length=16)


def _transformer(strategy: str, policy: str, odd_rank: int | None = None):
    """The test transformer (uneven sizes: many ranks hold nothing of a small tensor at W=64);
    ``odd_rank`` shards its first block with ``row`` instead (a diverged rank)."""

    def build(rank: int):
        with torch.device("meta"):
            model = make_model("transformer")
        if rank == odd_rank:
            fully_shard(model.block, strategy=strategy, policy="row")
            model = fully_shard(model, strategy=strategy, policy=policy)
        else:
            model = shard_model(model, strategy=strategy, policy=policy)
        optim = fully_shard_optimizer(make_adamw(model.parameters()))
        prime_adamw_state(optim)
        return model, optim

    return build


def _gpt(ep: int = 1, hsdp: str | None = None, mx: bool = False, strategy: str = "optim_grads_params"):
    """A GPT (MoE with ``ep``), over the job's real process groups: EP, HSDP / HFSDP, MXFP8."""

    def build(rank: int):
        config = MOE if ep > 1 or hsdp else get_preset("tiny")
        groups, place = None, None
        if ep > 1:
            mesh = init_expert_mesh(ep, config.num_experts)
            groups, place = dict(mesh.groups), expert_placement("even")
        if hsdp is not None:
            groups = {**(groups or {"dp": torch.distributed.group.WORLD}), **hsdp_groups(2)}
            place = hsdp_placement(
                place or (lambda n, p: Placement("even")), shard_optim_across_replicas=hsdp == "hfsdp"
            )
        with torch.device("meta"):
            model = GPTModel(config)
        if ep > 1:
            model = shard_experts(model, mesh)
        if mx:
            marked = {id(p) for p in linear_weights(model)}
            place = lambda n, p: mx_placement() if id(p) in marked else Placement("block(32)")  # noqa: E731
        for unit in shard_units(model):
            fully_shard(unit, mesh=groups, strategy=strategy, placement=place)
        optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        prime_adamw_state(optim)
        return model, optim

    return build


def _check(world: int, build, include_grads: bool = False) -> None:
    sim = simulate(world, build, include_grads=include_grads)
    sim.agree()
    assert same_plan_as_dcp(sim) == []
    # every chunk is written once, by one of the ranks holding it, and the commit's own check passed
    metadata, index = sim.commit()
    assert index["mesh"]["world"] == world and len(metadata.state_dict_metadata) > 0


@pytest.mark.parametrize("world", [1, 3, 5])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_derived_plan_equals_the_gathered_one_small_worlds(world, strategy, policy):
    _check(world, _transformer(strategy, policy), include_grads=strategy != "no_shard")


@pytest.mark.parametrize(("strategy", "policy"), [(s, p) for s, p in zip(STRATEGIES, POLICIES + ("even",))])
def test_derived_plan_equals_the_gathered_one_at_64_ranks(strategy, policy):
    _check(64, _transformer(strategy, policy))


@pytest.mark.parametrize("mode", ["hsdp", "hfsdp"])
def test_derived_plan_under_hsdp(mode):
    """Replicas hold the same pieces: each is written by one of them, spread over the replicas."""
    _check(4, _gpt(hsdp=mode))
    _check(6, _gpt(hsdp=mode, strategy="optim_grads"))


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (6, 3), (64, 4)])
def test_derived_plan_under_expert_parallelism(world, ep):
    """Each rank holds only its EP rank's experts: the others' are derived by renaming."""
    _check(world, _gpt(ep=ep))


def test_derived_plan_with_mxfp8_planes():
    _check(3, _gpt(mx=True))
    _check(4, _gpt(mx=True, strategy="optim"))


def test_a_diverged_rank_is_named_with_the_first_parameter_that_differs():
    sim = simulate(5, _transformer("optim_grads_params", "even", odd_rank=3))
    with pytest.raises(CheckpointError) as e:
        sim.agree()
    message = str(e.value)
    assert "\n" not in message
    assert "'block.attn_norm.weight'" in message and "rank 3" in message and "ranks 0-2, 4" in message, message
    assert "policy" in message, message


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("strategy", "policy"), [("optim_grads_params", "even"), ("no_shard", "even"), ("optim", "tensor")]
)
def test_derived_plan_equals_the_gathered_one_at_1024_ranks(strategy, policy):
    _check(1024, _transformer(strategy, policy))


@pytest.mark.heavy
def test_derived_plan_at_1024_ranks_with_experts_and_hsdp():
    _check(1024, _gpt(ep=4))
    _check(1024, _gpt(hsdp="hsdp"))


@pytest.mark.parametrize(("world", "policy"), [(3, "even"), (5, "row"), (5, "tensor"), (64, "even")])
def test_a_key_narrowed_to_a_range_gives_exactly_the_chunks_overlapping_it(world, policy):
    """What a load asks of the index (the chunks overlapping its shard, found by a binary search
    on the layout) is what filtering every chunk of the key gives: at W=64 most ranks hold
    nothing of a small tensor, and uneven sizes leave ragged pieces."""
    sim = simulate(world, _transformer("optim_grads_params", policy))
    sim.agree()
    _, index = sim.commit()
    catalog = Catalog.from_dict(index, plan_of_placed(sim.ranks[0].placed, {"dp": world}))
    rng = random.Random(world)
    checked = 0
    for key, info in catalog.keys.items():
        if isinstance(info.where, int):
            continue
        numel = math.prod(info.shape or ())
        every = catalog.chunks(key)
        bounds = sorted({0, numel, *(b.flat_start for _, b in every), *(rng.randrange(numel + 1) for _ in range(4))})
        ranges = [(lo, hi) for lo in bounds for hi in bounds if lo < hi] + [(numel, numel), (0, 1), (numel - 1, numel)]
        for lo, hi in ranges:
            expected = [(r, b) for r, b in every if b.flat_start < hi and b.flat_start + b.numel > lo and lo < hi]
            assert catalog.chunks(key, lo, hi) == expected, (key, lo, hi)
            checked += 1
    assert checked > 100
