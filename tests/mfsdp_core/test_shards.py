"""The shard description (the contract with mfsdp_ckpt) and byte-view collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_core import describe_shards, fully_shard_optimizer, refresh_compute_params
from mfsdp_core.collectives import all_gather
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model, shard_model

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _describe(strategy: str, policy: str) -> list[dict]:
    model = shard_model(make_model("transformer"), strategy=strategy, policy=policy)
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = batch(0, world)
    loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    optim.step()
    out = []
    for ps in describe_shards(model, optim):
        entry = {
            "fqn": ps.fqn,
            "shape": tuple(ps.shape),
            "dtype": ps.dtype,
            "owned": ps.owned,
            "group": (ps.group_size, ps.group_rank),
        }
        for kind in ("param", "main", "grad"):
            fs = getattr(ps, kind)
            entry[kind] = (fs.start, fs.end, fs.tensor.numel(), fs.tensor.dim())
        entry["optim"] = {k: (fs.start, fs.end, fs.tensor.numel()) for k, fs in ps.optim.items()}
        entry["extra"] = sorted(ps.optim_extra)
        entry["optim_param"] = (
            ps.optim_param is not None
            and ps.optim_param in optim.state
            and optim.state[ps.optim_param]["exp_avg"] is ps.optim["exp_avg"].tensor
        )
        # any rank's range is computable from the layout alone
        entry["all_owned"] = [(pc.start, pc.end) for pc in (ps.layout.piece(ps.index, r) for r in range(ps.group_size))]
        out.append(entry)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("policy", ["even", "row"])
def test_description_covers_every_parameter_once(ranks, strategy, policy):
    world = 3
    per_rank = ranks(_describe, world, strategy, policy, timeout=300)
    names = [n for n, _ in make_model("transformer").named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in make_model("transformer").named_parameters()}
    for entries in per_rank:
        assert sorted(e["fqn"] for e in entries) == sorted(names)  # canonical names, root-relative
    for fqn in sorted(names):
        entries = [next(e for e in rank_entries if e["fqn"] == fqn) for rank_entries in per_rank]
        numel = torch.Size(shapes[fqn]).numel()
        for e in entries:
            assert e["shape"] == shapes[fqn] and e["dtype"] == torch.float32
            assert e["main"][2] == e["main"][1] - e["main"][0] and e["main"][3] == 1
            assert (e["main"][0], e["main"][1]) == e["owned"]
            assert e["optim"] == {k: e["owned"] + (e["owned"][1] - e["owned"][0],) for k in ("exp_avg", "exp_avg_sq")}
            assert e["extra"] == ["step"]
            assert e["optim_param"]  # the optimizer's own handle for this parameter's state
            whole = (0, numel, numel, 1)
            assert e["param"] == (e["main"] if strategy == "optim_grads_params" else whole)
            assert e["grad"] == e["main"]  # the owned range (ZeRO-1 keeps replicas of the rest)
        if strategy == "no_shard":
            assert all(e["owned"] == (0, numel) and e["group"] == (1, 0) for e in entries)
            continue
        owned = sorted(e["owned"] for e in entries if e["owned"][1] > e["owned"][0])
        assert owned[0][0] == 0 and owned[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(owned, owned[1:])), owned  # disjoint, no gaps
        assert all(e["all_owned"] == [x["owned"] for x in entries] for e in entries)


def _write_main_then_refresh(strategy: str) -> bool:
    """What a checkpoint load does: write main params in place, refresh; the next forward must
    use the new weights (bitwise equal to an unsharded model holding them)."""
    model = shard_model(make_model("transformer"), strategy=strategy, policy="row")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    source = dict(make_model("transformer", seed=7).named_parameters())
    for ps in describe_shards(model, optim):
        ps.main.tensor.copy_(source[ps.fqn].detach().reshape(-1)[ps.main.start : ps.main.end])
    refresh_compute_params(model)
    x, _ = batch(0, 1)
    with torch.no_grad():
        return torch.equal(model(x), make_model("transformer", seed=7)(x))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_writing_main_params_then_refresh_updates_compute_params(ranks, strategy):
    assert all(ranks(_write_main_then_refresh, 3, strategy, timeout=300))


def _gather_bytes_dtypes() -> list[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.bfloat16):
        full = (torch.arange(world * 5, dtype=torch.float32) / 4 + 1).to(dtype)
        out = torch.empty(world * 5, dtype=dtype)
        all_gather(out, full[rank * 5 : (rank + 1) * 5].clone(), dist.group.WORLD)
        results.append(torch.equal(out.view(torch.uint8), full.view(torch.uint8)))
    return results


def test_fp8_and_e8m0_travel_as_bytes(ranks):
    for r in ranks(_gather_bytes_dtypes, 3, timeout=120):
        assert r == [True] * 4
