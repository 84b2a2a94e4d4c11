"""Parity of sharded training with a single-process data-parallel reference (AdamW, 5 steps).

Bitwise where the arithmetic is the same: world size 1 (every strategy and policy) and
``no_shard`` (every rank steps on whole parameters, and gradients are reduced in rank order, as the
reference does). Sharded runs step on flat pieces of parameters; elementwise kernels may treat a
piece's tail differently from the whole tensor's (vectorised vs. scalar loops, FMA), so there we
allow a relative error of 1e-6 per tensor: max|ours - ref| <= 1e-6 * max|ref|.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from mfsdp_core import describe_shards, fully_shard_optimizer
from mfsdp_core.layout import POLICY_NAMES  # noqa: F401  (documents the policy set)
from tests.mfsdp_core.models import (
    OPTIMIZERS,
    batch,
    loss_fn,
    make_adamw,
    make_model,
    reference_run,
    shard_model,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
POLICIES = ["even", "row", "block(32)", "tensor"]
STEPS = 5
REL_TOL = 1e-6


def _rel_err(ours: torch.Tensor, ref_full: torch.Tensor, start: int, end: int) -> float:
    ref = ref_full.detach().reshape(-1).float()
    diff = (ours.detach().float() - ref[start:end]).abs().max().item() if end > start else 0.0
    scale = ref.abs().max().item() or 1.0
    return diff / scale


def train_sharded(
    name: str, strategy: str, policy: str, steps: int, micro_batches: int = 1, optimizer: str = "adamw", **kwargs
):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_model(make_model(name), strategy=strategy, policy=policy, **kwargs)
    optim = fully_shard_optimizer(OPTIMIZERS[optimizer](model.parameters()))
    losses = []
    for step in range(steps):
        x, y = batch(step, world, per_rank=3 * micro_batches)
        xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
        for mb in range(micro_batches):
            loss = loss_fn(model, xr.chunk(micro_batches)[mb], yr.chunk(micro_batches)[mb]) / micro_batches
            loss.backward()
            if mb == 0:
                losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return model, optim, losses


def compare(model, optim, losses, ref_model, ref_optim, ref_losses, steps: int = STEPS) -> dict:
    """Worst relative error over compute params, main params, optimizer state and losses on this
    rank, and whether every one of them was bitwise equal."""
    rank = dist.get_rank()
    ref_params = dict(ref_model.named_parameters())
    worst, bitwise, empty_piece = 0.0, True, False
    for ps in describe_shards(model, optim):
        ref = ref_params[ps.fqn]
        state = ref_optim.state[ref]
        tensor_state = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == ref.shape}
        assert set(ps.optim) == tensor_state, (ps.fqn, set(ps.optim), tensor_state)
        pairs = [(ps.param, ref), (ps.main, ref)] + [(ps.optim[k], state[k]) for k in sorted(tensor_state)]
        for shard, full in pairs:
            err = _rel_err(shard.tensor, full, shard.start, shard.end)
            worst = max(worst, err)
            expected = full.detach().reshape(-1)[shard.start : shard.end].to(shard.tensor.dtype)
            bitwise &= torch.equal(shard.tensor, expected)
        if "step" in state:
            assert ps.optim_extra["step"].item() == steps
        empty_piece |= ps.owned[0] == ps.owned[1]
    for ours, ref in zip(losses, ref_losses):
        worst = max(worst, abs(ours - ref[rank]) / abs(ref[rank]))
        bitwise &= ours == ref[rank]
    return {"worst": worst, "bitwise": bitwise, "empty_piece": empty_piece}


def _parity_matrix(models: list[str]) -> dict:
    world = dist.get_world_size()
    refs = {name: reference_run(name, world, STEPS) for name in models}
    results = {}
    for name, strategy, policy in itertools.product(models, STRATEGIES, POLICIES):
        model, optim, losses = train_sharded(name, strategy, policy, STEPS)
        results[(name, strategy, policy)] = compare(model, optim, losses, *refs[name])
    return results


def _merge(per_rank: list[dict]) -> dict:
    merged = {}
    for key in per_rank[0]:
        rs = [r[key] for r in per_rank]
        merged[key] = {
            "worst": max(r["worst"] for r in rs),
            "bitwise": all(r["bitwise"] for r in rs),
            "empty_piece": any(r["empty_piece"] for r in rs),
        }
    return merged


@pytest.mark.heavy
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_adamw_parity_matrix(ranks, world_size):
    merged = _merge(ranks(_parity_matrix, world_size, ["mlp", "transformer"], timeout=600))
    assert len(merged) == 2 * len(STRATEGIES) * len(POLICIES)
    failures = []
    for (name, strategy, policy), r in merged.items():
        must_be_bitwise = world_size == 1 or strategy == "no_shard"
        if must_be_bitwise and not r["bitwise"]:
            failures.append(f"{name}/{strategy}/{policy}: not bitwise (worst rel err {r['worst']:.3g})")
        elif r["worst"] > REL_TOL:
            failures.append(f"{name}/{strategy}/{policy}: worst rel err {r['worst']:.3g} > {REL_TOL}")
    assert not failures, "\n".join(failures)
    if world_size >= 2:  # the matrix really contains ranks owning nothing of some parameter
        assert any(r["empty_piece"] for r in merged.values())


def _accumulation_and_clipping() -> dict:
    """Two micro-batches per step (gradients reduced per micro-batch and accumulated), then a
    global-norm clip compared with torch.nn.utils.clip_grad_norm_ on the reference gradients."""
    from mfsdp_core import clip_grad_norm_

    world = dist.get_world_size()
    out = {}
    ref = reference_run("transformer", world, 3, micro_batches=2)
    for strategy in STRATEGIES:
        model, optim, losses = train_sharded("transformer", strategy, "even", 3, micro_batches=2)
        out[strategy] = compare(model, optim, losses, *ref, steps=3)["worst"]
    # clipping: one backward, then compare the norms and the clipped gradients
    for strategy in STRATEGIES:
        model = shard_model(make_model("transformer"), strategy=strategy, policy="row")
        optim = fully_shard_optimizer(make_adamw(model.parameters()))
        ref_model = make_model("transformer")
        x, y = batch(0, world)
        loss_fn(model, x.chunk(world)[dist.get_rank()], y.chunk(world)[dist.get_rank()]).backward()
        grads = []
        for r in range(world):
            ref_model.zero_grad()
            loss_fn(ref_model, x.chunk(world)[r], y.chunk(world)[r]).backward()
            grads.append([p.grad.clone() for p in ref_model.parameters()])
        for k, p in enumerate(ref_model.parameters()):
            p.grad = sum(g[k] for g in grads) / world
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        norm = clip_grad_norm_(optim, 0.05)
        ref_grads = dict((n, p.grad) for n, p in ref_model.named_parameters())
        worst = 0.0
        for ps in describe_shards(model, optim):
            worst = max(worst, _rel_err(ps.grad.tensor, ref_grads[ps.fqn], ps.grad.start, ps.grad.end))
        out[f"clip/{strategy}"] = max(worst, abs(norm.item() - ref_norm.item()) / ref_norm.item())
        assert ref_norm.item() > 0.05  # the clip really scaled
    return out


@pytest.mark.parametrize("world_size", [1, 3])
def test_grad_accumulation_and_clipping(ranks, world_size):
    per_rank = ranks(_accumulation_and_clipping, world_size, timeout=300)
    for key in per_rank[0]:
        worst = max(r[key] for r in per_rank)
        assert worst <= REL_TOL, f"{key}: rel err {worst:.3g}"


def _bf16_mixed_precision() -> dict:
    """bf16 compute params, fp32 main params and reduction; vs. a reference that keeps fp32
    masters and computes with bf16 copies. Loose tolerance: bf16 forward/backward."""
    from mfsdp_core import MixedPrecision

    rank, world = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = shard_model(make_model("mlp"), strategy="optim_grads_params", policy="even", mixed_precision=mp)
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    master = make_model("mlp")
    ref_optim = make_adamw(master.parameters())
    compute = make_model("mlp").to(torch.bfloat16)
    for step in range(3):
        x, y = batch(step, world)
        loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.copy_(m)
        grads = []
        for r in range(world):
            compute.zero_grad()
            loss_fn(compute, x.chunk(world)[r].bfloat16(), y.chunk(world)[r]).backward()
            grads.append([p.grad.float() for p in compute.parameters()])
        for k, p in enumerate(master.parameters()):
            total = grads[0][k].clone()
            for r in range(1, world):
                total.add_(grads[r][k])
            p.grad = total.div_(world)
        ref_optim.step()
    ref = dict(master.named_parameters())
    worst = 0.0
    dtypes = set()
    for ps in describe_shards(model, optim):
        dtypes.add((ps.dtype, ps.main.tensor.dtype))
        worst = max(worst, _rel_err(ps.main.tensor, ref[ps.fqn], ps.main.start, ps.main.end))
        worst = max(worst, _rel_err(ps.param.tensor, ref[ps.fqn].bfloat16(), ps.param.start, ps.param.end))
    return {"worst": worst, "dtypes": dtypes}


def test_bf16_mixed_precision(ranks):
    for r in ranks(_bf16_mixed_precision, 2, timeout=300):
        assert r["dtypes"] == {(torch.bfloat16, torch.float32)}
        # bf16 has 8 bits of mantissa: one rounding of a compute copy is <= 2^-8 relative
        assert r["worst"] <= 2**-8, r["worst"]


def _sgd_momentum_parity() -> dict:
    world = dist.get_world_size()
    ref = reference_run("transformer", world, STEPS, optimizer="sgd")
    out = {}
    for strategy, policy in itertools.product(STRATEGIES, ["even", "tensor"]):
        model, optim, losses = train_sharded("transformer", strategy, policy, STEPS, optimizer="sgd")
        out[(strategy, policy)] = compare(model, optim, losses, *ref)
    return out


def test_sgd_with_momentum_parity(ranks):
    merged = _merge(ranks(_sgd_momentum_parity, 3, timeout=300))
    for (strategy, policy), r in merged.items():
        assert r["worst"] <= REL_TOL, (strategy, policy, r)
        if strategy == "no_shard":
            assert r["bitwise"], (strategy, policy, r)
