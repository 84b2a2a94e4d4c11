"""Muon on a sharded model: whole matrices under ``tensor`` placement, owner-compute under flat
placements, both equal to one process; per-shard Newton–Schulz would be wrong; the owner-compute
traffic moves each matrix once each way (real gloo processes).

Parity is bitwise: the runtime reduces gradients in rank order exactly as the single-process
data-parallel reference does (both with one thread per process), Muon's and AdamW's elementwise
steps are written without fused multiply-adds (a piece computes what the whole tensor would), and
Newton–Schulz runs on the same whole matrix wherever it runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_core import count_comm, describe_shards, fully_shard, fully_shard_optimizer
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_units
from mfsdp_core.muon import (
    Muon,
    muon_owners,
    muon_param_groups,
    newton_schulz5,
    uses_muon,
)

CONFIG = get_preset("tiny")
STEPS = 10


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2 * world, 17), generator=torch.Generator().manual_seed(700 + step))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _optimizer(model, ns_dtype: str) -> Muon:
    return Muon(
        muon_param_groups(model, lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01), ns_dtype=ns_dtype
    )


def _train(policy: str, strategy: str, ns_dtype: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    for unit in shard_units(model):
        fully_shard(unit, policy=policy, strategy=strategy)
    optim = fully_shard_optimizer(_optimizer(model, ns_dtype))
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step, world)[2 * rank : 2 * rank + 2])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    state = {}
    for ps in describe_shards(model, optim):
        state[ps.fqn] = (ps.owned, ps.main.tensor.clone(), {k: v.tensor.clone() for k, v in ps.optim.items()})
    return {"losses": losses, "state": state}


def _reference(world: int, ns_dtype: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a matmul's sums split over threads would differ
    try:
        torch.manual_seed(0)
        model = GPTModel(CONFIG)
        optim = _optimizer(model, ns_dtype)
        params = list(model.parameters())
        losses = []
        for step in range(STEPS):
            tokens, grads, per_rank = _batch(step, world), [], []
            for r in range(world):
                model.zero_grad(set_to_none=True)
                loss = _loss(model, tokens[2 * r : 2 * r + 2])
                loss.backward()
                grads.append([p.grad.clone() for p in params])
                per_rank.append(loss.item())
            for k, p in enumerate(params):
                total = grads[0][k].clone()
                for r in range(1, world):
                    total.add_(grads[r][k])
                p.grad = total.div_(world)
            optim.step()
            losses.append(per_rank)
        names = dict(model.named_parameters())
        return {
            "losses": losses,
            "state": {
                n: (p.detach().clone(), {k: v.clone() for k, v in optim.state[p].items() if k != "step"})
                for n, p in names.items()
            },
        }
    finally:
        torch.set_num_threads(threads)


def _runs(runs: list[tuple[str, str, str]]) -> list[dict]:
    return [_train(*run) for run in runs]


RUNS = [
    ("tensor", "optim_grads_params", "bfloat16"),
    ("even", "optim_grads_params", "bfloat16"),
    ("row", "optim", "float32"),
    ("tensor", "no_shard", "float32"),
    ("even", "optim_grads", "float32"),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_muon_matches_one_process_bitwise_in_both_modes(ranks, world):
    """10 steps of `tiny` with Muon (hidden matrices) + AdamW (the rest) at world sizes 1-4: under
    `tensor` placement (whole matrices) and under flat placements (owner-compute), with bf16 and
    fp32 Newton-Schulz: parameters, momentum, AdamW state and losses bitwise equal to one process."""
    out = ranks(_runs, world, RUNS, timeout=600)
    refs = {d: _reference(world, d) for d in ("bfloat16", "float32")}
    for i, (policy, strategy, ns_dtype) in enumerate(RUNS):
        ref = refs[ns_dtype]
        for rank, per_rank in enumerate(out):
            run = per_rank[i]
            assert run["losses"] == [step[rank] for step in ref["losses"]], (world, policy, strategy, ns_dtype, rank)
            for fqn, ((lo, hi), main, optim) in run["state"].items():
                full, full_state = ref["state"][fqn]
                assert torch.equal(main.reshape(-1), full.reshape(-1)[lo:hi]), (world, policy, strategy, fqn)
                assert set(optim) == set(full_state), fqn
                for key, value in optim.items():
                    assert torch.equal(value.reshape(-1), full_state[key].reshape(-1)[lo:hi]), (world, policy, fqn, key)


def test_per_shard_newton_schulz_is_not_the_whole_matrix_one():
    """Orthogonalizing row shards separately gives another matrix: the owner-compute mode exists
    because a regression to per-shard Newton-Schulz would change training."""
    u = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    whole = newton_schulz5(u, dtype=torch.float32)
    per_shard = torch.cat([newton_schulz5(part, dtype=torch.float32) for part in u.chunk(3)])
    assert (whole - per_shard).abs().max() > 0.1
    singular = torch.linalg.svdvals(whole)  # the quintic iteration lands them in about [0.7, 1.2]
    assert 0.5 < singular.min() and singular.max() < 1.5


def test_owners_are_deterministic_and_balanced():
    costs = [64 * 128 * 64, 64 * 64 * 64, 256 * 64 * 64, 64 * 128 * 64, 64 * 64 * 64, 256 * 64 * 64]
    owners = muon_owners(costs, 3)
    assert owners == muon_owners(costs, 3) == [2, 0, 0, 2, 1, 1]  # costliest first, onto the least loaded
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(costs)


def test_the_rule_keeps_embeddings_head_norms_and_vectors_on_adamw():
    model = GPTModel(CONFIG)
    muon = sorted(n for n, p in model.named_parameters() if uses_muon(n, p))
    assert "embedding.word_embeddings.weight" not in muon and "output_layer.weight" not in muon
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in muon
    assert not any(n.endswith(("layer_norm_weight", "final_layernorm.weight")) for n in muon)
    with pytest.raises(ValueError, match=r"use_muon group holds a parameter of shape \(64,\)"):
        Muon([{"params": [model.decoder.final_layernorm.weight], "use_muon": True}])


def _counted_step(policy: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    for unit in shard_units(model):
        fully_shard(unit, policy=policy)
    optim = fully_shard_optimizer(_optimizer(model, "bfloat16"))
    _loss(model, _batch(0, world)[2 * rank : 2 * rank + 2]).backward()
    with count_comm() as comm:
        optim.step()
    return {
        "records": [(r.op, r.dtype, r.bytes) for r in comm.records],
        "matrices": sum(p.numel() for n, p in GPTModel(CONFIG).named_parameters() if uses_muon(n, p)),
    }


def test_owner_compute_moves_each_matrix_once_each_way(ranks):
    """4 ranks, `even`: the step's only traffic is two all-to-alls; over all ranks they carry each
    Muon matrix's elements exactly once to its owner (fp32 momentum input) and once back (bf16
    update), against 4 x the fp32 matrices for gathering every full matrix on every rank.
    Under `tensor` the step communicates nothing."""
    out = ranks(_counted_step, 4, "even", timeout=300)
    n = out[0]["matrices"]
    for o in out:
        assert [op for op, _, _ in o["records"] if op not in ("all_gather",)] == ["all_to_all", "all_to_all"], o[
            "records"
        ]
    to_owner = sum(o["records"][0][2] for o in out if o["records"][0][0] == "all_to_all")
    back = sum([r for r in o["records"] if r[0] == "all_to_all"][1][2] for o in out)
    assert to_owner == 4 * n and back == 2 * n
    gather_all = 4 * 4 * n  # every rank receiving every full fp32 matrix
    print(
        f"owner-compute: {to_owner + back:,} bytes per step over 4 ranks vs {gather_all:,} to gather every matrix "
        f"on every rank ({gather_all / (to_owner + back):.1f}x)"
    )
    tensor = ranks(_counted_step, 4, "tensor", timeout=300)
    assert all(not [r for r in o["records"] if r[0] != "all_gather"] for o in tensor)
