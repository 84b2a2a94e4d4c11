"""HSDP and HFSDP (``mfsdp_core.hsdp``): shard inside groups, replicate across them.

The losses of a 2 × 2 mesh equal flat ZeRO-3 on 4 ranks within 1e-5 relative (the gradients are
summed in another order: inside the shard group, then across the replicas; both reductions are
deterministic, so the replicas stay bitwise equal); the refined optimizer layout of HFSDP is
checked as pure data with odd sizes and empty shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_core import clip_grad_norm_, count_comm, describe_shards, fully_shard, fully_shard_optimizer
from mfsdp_core.expert_parallel import expert_placement, init_expert_mesh
from mfsdp_core.hsdp import REPLICATE_GROUP, SHARD_GROUP, check_replicas, hsdp_groups, hsdp_placement
from mfsdp_core.layout import compute_layout, refine_layout
from mfsdp_core.mixed_precision import MixedPrecision
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units
from mfsdp_core.plan import Placement, placement_fn, plan_unit
from mfsdp_core.strategy import Strategy

STEPS = 6


def _build(mode: str, strategy: str, policy: str = "even", ep: int = 1, model: str = "tiny"):
    config = get_preset(model)
    groups: dict = {"dp": dist.group.WORLD}
    place = placement_fn(None, policy)
    if ep > 1:
        mesh = init_expert_mesh(ep, config.num_experts)
        groups = dict(mesh.groups)
        place = expert_placement(policy)
    if mode != "flat":
        groups.update(hsdp_groups(2))
        place = hsdp_placement(place, shard_optim_across_replicas=mode == "hfsdp")
    torch.manual_seed(0)
    net = GPTModel(config)
    if ep > 1:
        net = shard_experts(net, mesh)
    for unit in shard_units(net):
        fully_shard(unit, mesh=groups, strategy=strategy, placement=place)
    optim = fully_shard_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
    return net, optim


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, 256, (2, 17), generator=g)


def _train(net, optim, steps: int = STEPS) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in range(steps):
        tokens = _tokens(step)
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        (loss + getattr(net, "aux_loss", 0.0)).backward()
        norms.append(clip_grad_norm_(optim, 1e9).item())
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, norms


def _losses(mode: str, strategy: str, policy: str, ep: int, model: str) -> dict:
    net, optim = _build(mode, strategy, policy, ep, model)
    losses, norms = _train(net, optim)
    shards = describe_shards(net, optim)
    return {
        "losses": losses,
        "norms": norms,
        "main": {ps.fqn: (ps.main.start, ps.main.end, ps.main.tensor.clone()) for ps in shards},
        "optim_elements": sum(fs.tensor.numel() for ps in shards for fs in ps.optim.values()),
    }


@pytest.mark.parametrize(
    "strategy, policy, ep, model",
    [
        ("optim_grads_params", "even", 1, "tiny"),
        ("optim_grads", "row", 1, "tiny"),
        ("optim_grads_params", "tensor", 1, "tiny"),
        ("optim_grads_params", "even", 2, "tiny-moe"),
    ],
)
def test_hsdp_and_hfsdp_train_as_flat_fsdp(ranks, strategy, policy, ep, model):
    flat = ranks(_losses, 4, "flat", strategy, policy, ep, model, timeout=300)
    for mode in ("hsdp", "hfsdp"):
        out = ranks(_losses, 4, mode, strategy, policy, ep, model, timeout=300)
        for a, b in zip(out[0]["losses"], flat[0]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (mode, out[0]["losses"], flat[0]["losses"])
        for a, b in zip(out[0]["norms"], flat[0]["norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), (mode, out[0]["norms"], flat[0]["norms"])
        if mode == "hsdp":  # ranks g and g + 2 are replicas: bitwise the same state
            for g in (0, 1):
                for name, (lo, hi, t) in out[g]["main"].items():
                    if "experts." in name:  # experts stay sharded over their expert-data-parallel group
                        continue
                    lo2, hi2, t2 = out[g + 2]["main"][name]
                    assert (lo, hi) == (lo2, hi2) and torch.equal(t, t2), name
        else:  # every main-param element on exactly one rank, as in the flat run
            for name in flat[0]["main"]:
                ranges = sorted((r["main"][name][0], r["main"][name][1]) for r in out if name in r["main"])
                if ep == 1:
                    covered = [x for lo, hi in ranges for x in range(lo, hi)]
                    assert covered == list(range(len(covered))), name
            if ep == 1:
                assert sum(r["optim_elements"] for r in out) == sum(r["optim_elements"] for r in flat)


def _hsdp_comm() -> dict:
    out = {}
    for mode in ("flat", "hsdp", "hfsdp"):
        net, optim = _build(mode, "optim_grads_params")
        tokens = _tokens(0)
        with count_comm() as counter:
            logits = net(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            optim.step()
        out[mode] = [(r.op, r.bytes, r.ranks) for r in counter.records]
    return out


def test_hsdp_gathers_inside_the_shard_group_and_reduces_once_across(ranks):
    out = ranks(_hsdp_comm, 4, timeout=300)[0]
    flat_gather = sum(b for op, b, _ in out["flat"] if op == "all_gather")
    for mode in ("hsdp", "hfsdp"):
        records = out[mode]
        param_gathers = [r for r in records if r[0] == "all_gather" and r[2] == (0, 1)]
        across = [r for r in records if r[2] == (0, 2)]
        assert all(r[2] in ((0, 1), (0, 2), (0, 1, 2, 3)) for r in records)
        # parameters travel inside the shard group: the same logical bytes as flat FSDP's gathers
        assert sum(b for _, b, _ in param_gathers) == flat_gather
        # across the replicas: one reduction per buffer (all-reduce for HSDP, reduce-scatter for
        # HFSDP), and for HFSDP one all-gather per buffer after the step
        want = {"hsdp": {"all_reduce"}, "hfsdp": {"reduce_scatter", "all_gather"}}[mode]
        assert {op for op, _, _ in across} == want


def _hfsdp_refuses(strategy: str) -> str:
    groups = {"dp": dist.group.WORLD, **hsdp_groups(2)}
    torch.manual_seed(0)
    net = GPTModel(get_preset("tiny"))
    try:
        fully_shard(
            net,
            mesh=groups,
            strategy=strategy,
            placement=hsdp_placement(placement_fn(None, "even"), shard_optim_across_replicas=True),
        )
    except ValueError as e:
        return str(e)
    return ""


def test_hfsdp_needs_sharded_gradients(ranks):
    msg = ranks(_hfsdp_refuses, 4, "optim", timeout=120)[0]
    assert "HFSDP" in msg and "optim_grads" in msg


def test_replica_count_must_divide_world_size():
    with pytest.raises(ValueError, match="3 replicas do not divide the world size 4"):
        check_replicas(4, 3)


@pytest.mark.parametrize("policy", ["even", "row", "block(2)", "tensor"])
@pytest.mark.parametrize("n, parts", [(1, 3), (3, 2), (2, 5), (3, 3)])
def test_refine_layout_splits_each_segment_on_the_policys_cuts(policy, n, parts):
    shapes = [(6, 5), (3,), (4, 3), (0, 7), (10, 1)]
    base = compute_layout(shapes, n, policy)
    fine = refine_layout(base, parts)
    assert fine.group_size == n * parts
    for r in range(n):  # the parts of rank r tile its segment, in order
        assert fine.bounds[r * parts] == base.bounds[r] and fine.bounds[(r + 1) * parts] == base.bounds[r + 1]
    assert list(fine.bounds) == sorted(fine.bounds)
    for i, shape in enumerate(base.shapes):
        pieces = fine.owners(i)
        assert sum(pc.numel for pc in pieces) == shape.numel()
        atom = base.policy.atom(shape)
        for pc in pieces:  # cuts inside a parameter fall on its atoms
            assert pc.start % atom == 0
            assert pc.shard_offset + pc.numel <= fine.shard_size


def test_refine_layout_gives_empty_parts_when_a_segment_is_small():
    fine = refine_layout(compute_layout([(2,), (1, 1)], 3, "tensor"), 2)
    sizes = [fine.bounds[w + 1] - fine.bounds[w] for w in range(6)]
    assert sorted(sizes) == [0, 0, 0, 0, 1, 2] and fine.shard_size == 2
    assert refine_layout(compute_layout([(4,)], 2), 1) == compute_layout([(4,)], 2)


def test_plan_records_the_replicas_and_round_trips():
    net = torch.nn.Linear(6, 5)
    place = Placement("even", group=SHARD_GROUP, replicate=REPLICATE_GROUP, shard_optim_across_replicas=True)
    ((spec, _),) = plan_unit(
        net,
        placement=lambda n, p: place,
        group_sizes={"dp": 6, SHARD_GROUP: 3, REPLICATE_GROUP: 2},
        strategy=Strategy.OPTIM_GRADS_PARAMS,
        mixed_precision=MixedPrecision(),
    )
    assert spec.grad_divisor == 6 and spec.optim_layout.group_size == 6 and spec.layout.group_size == 3
    again = type(spec).from_dict(spec.to_dict())
    assert again == spec and again.optim_layout == spec.optim_layout
    flat = spec.unreplicated()
    assert flat.placement.group == "dp" and flat.group_size == 6 and flat.optim_layout.group_size == 6
    assert dataclasses.replace(flat, placement=place).placement.replicate == REPLICATE_GROUP


@pytest.mark.parametrize(
    "field, value, problem",
    [("replicate_size", 0, "outside [1,"), ("replicate", 3, "expected"), ("shard_optim_across_replicas", "yes", "")],
)
def test_manifest_schema_checks_the_replica_fields(field, value, problem):
    from mfsdp_ckpt import CorruptCheckpointError
    from mfsdp_ckpt.format.manifest_schema import check_manifest

    net = torch.nn.Linear(6, 5)
    place = Placement("even", group=SHARD_GROUP, replicate=REPLICATE_GROUP)
    sizes = {"dp": 4, SHARD_GROUP: 2, REPLICATE_GROUP: 2}
    specs = plan_unit(
        net,
        placement=lambda n, p: place,
        group_sizes=sizes,
        strategy=Strategy.OPTIM_GRADS_PARAMS,
        mixed_precision=MixedPrecision(),
    )
    buffer = specs[0][0].to_dict()
    manifest = {"format": "mfsdp-ckpt", "chunks": {}, "writer": {"plan": {"group_sizes": sizes, "buffers": [buffer]}}}
    check_manifest(manifest, "m")
    buffer[field] = value
    with pytest.raises(CorruptCheckpointError) as e:
        check_manifest(manifest, "m")
    assert str(e.value).startswith(f"m: field 'writer.plan.buffers[0].{field}': ") and problem in str(e.value)
