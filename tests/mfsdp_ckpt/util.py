"""Helpers for checkpoint tests: training a test model over a step range, and this rank's owned
pieces of every canonical tensor (to assemble / compare logical tensors across layouts)."""

from __future__ import annotations

import torch

from mfsdp_core import describe_shards, fully_shard_optimizer
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps  # noqa: F401 (train_steps: re-exported)


def build(strategy: str, policy: str, seed: int = 0, name: str = "transformer"):
    model = shard_model(make_model(name, seed=seed), strategy=strategy, policy=policy)
    return model, fully_shard_optimizer(make_adamw(model.parameters()))


def owned_pieces(model, optim, grads: bool = False) -> dict[str, tuple[int, int, torch.Tensor]]:
    """Canonical key -> (start, end, values) of the range this rank owns."""
    out = {}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        param = ps.param.tensor[lo - ps.param.start : hi - ps.param.start]
        out[f"model.{ps.fqn}"] = (lo, hi, param.clone())
        out[f"main.{ps.fqn}"] = (lo, hi, ps.main.tensor.clone())
        for k, fs in ps.optim.items():
            out[f"optim.{ps.fqn}.{k}"] = (lo, hi, fs.tensor.clone())
        if grads:
            g = ps.grad.tensor[lo - ps.grad.start : hi - ps.grad.start]
            out[f"grad.{ps.fqn}"] = (lo, hi, g.clone())
    return out


def assemble(per_rank: list[dict], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full logical tensors from every rank's owned pieces; asserts each element is covered
    exactly once (replicated ranks owning the same range must agree bitwise)."""
    full = {}
    for key in per_rank[0]:
        fqn = key.split(".", 1)[1]
        fqn = fqn.rsplit(".", 1)[0] if key.startswith("optim.") else fqn
        numel = shapes[fqn].numel()
        flat = torch.full((numel,), float("nan"), dtype=per_rank[0][key][2].dtype)
        seen = torch.zeros(numel, dtype=torch.int32)
        ranges = {}
        for pieces in per_rank:
            lo, hi, values = pieces[key]
            if (lo, hi) in ranges:  # a replica (no_shard): must be identical
                assert torch.equal(ranges[(lo, hi)], values), key
                continue
            ranges[(lo, hi)] = values
            flat[lo:hi] = values
            seen[lo:hi] += 1
        assert bool((seen == 1).all()), f"{key}: elements covered {seen.min().item()}..{seen.max().item()} times"
        full[key] = flat.view(shapes[fqn])
    return full


def shapes_of(name: str = "transformer") -> dict[str, torch.Size]:
    return {n: p.shape for n, p in make_model(name).named_parameters()}
