"""Genuine Megatron-Core ``GPTModel`` s (local spec, CPU, gloo) under our ``fully_shard``
(``mfsdp_core.models.mcore``): trained at 1 and 2 ranks they agree; they agree with MCore's own
unsharded training (same init, data, Adam; MCore's own loss); the checkpoint names equal the ones
MCore's ``sharded_state_dict`` gives (its keys map of the local spec, the experts' global offsets);
experts are placed on the expert-data-parallel group with the data-parallel divisor.

Needs megatron-core (``pip install 'mfsdp-ckpt[mcore]'``, which ``make`` installs): without it the
module fails to import rather than skip, so that CI cannot pass without running it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_core import fully_shard, fully_shard_optimizer, plan_of, rename_params
from mfsdp_core.expert_parallel import EDP_GROUP, init_expert_mesh
from mfsdp_core.models import mcore
from tests.harness import run_ranks

pytestmark = pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it

VOCAB, SEQ, BATCH, LR, SEED = 64, 16, 4, 1e-2, 5
DENSE = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=64
)
MOE = dict(
    DENSE,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_grouped_gemm=False,
    moe_token_dispatcher_type="allgather",
    moe_aux_loss_coeff=0.0,
)


def _config(moe: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **(MOE if moe else DENSE),
        layernorm_epsilon=1e-5,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _build(moe: bool, ep: int):
    mcore.prepare_cpu()
    return mcore.build_gpt(
        _config(moe),
        vocab_size=VOCAB,
        max_sequence_length=32,
        tied=False,
        rotary_base=10000.0,
        layer_spec="local",
        ep_size=ep,
        seed=SEED,
    )


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches in turn: the loss falls
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def _train_ours(moe: bool, ep: int, steps: int) -> dict:
    """``steps`` Adam steps of the fully_shard-ed MCore model on this rank's slice of each global
    batch; the global mean losses, and the plan's expert buffers (group, divisor, names)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_expert_mesh(ep, 4) if ep > 1 else None
    model = _build(moe, ep)
    names = mcore.canonical_names(model)
    sharded = _sharded_names(model, moe)
    place = mcore.placement("even", mesh)
    for unit in mcore.shard_units(model):
        fully_shard(unit, mesh=None if mesh is None else mesh.groups, placement=place)
    rename_params(model, lambda fqn: names[fqn])
    optim = fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    per = BATCH // world
    losses = []
    for step in range(steps):
        tokens = _batch(step)[rank * per : (rank + 1) * per]
        logits, aux = mcore.forward(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        (loss + aux).backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    experts = [
        (b.placement.group, b.placement.grad_divisor, b.group_size, b.prefix + b.names[0])
        for b in plan_of(model).buffers
        if b.is_expert
    ]
    return {"losses": losses, "experts": experts, "names": names, "sharded": sharded}


def _train_mcore_alone(moe: bool, steps: int) -> list[float]:
    """MCore's own training, no sharding: the same init and batches, ``torch.optim.Adam`` with the
    same hyper-parameters, MCore's own loss (``labels=``: its vocab-parallel cross-entropy)."""
    model = _build(moe, 1)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        tokens = _batch(step)
        inputs = tokens[:, :-1]
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        masked = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        loss = model(inputs, positions, masked, labels=tokens[:, 1:]).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded_names(model, moe: bool) -> dict[str, str]:
    """``{module fqn: canonical name}`` as MCore's own ``sharded_state_dict`` says: its stacked key
    (the local spec's keys map applied) at the global offset of the layer (and expert), turned
    into a canonical name by ``import-mcore``'s key layout."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    from mfsdp_ckpt.mcore.layout import model_pieces

    params = {name for name, _ in model.named_parameters()}
    out = {}
    for fqn, value in model.sharded_state_dict().items():
        if fqn not in params:
            continue
        if isinstance(value, ShardedTensorFactory):
            value = value.build()[0]
        assert isinstance(value, ShardedTensor), fqn
        pieces = model_pieces(value.key, tuple(value.global_shape), moe)
        at = [p for p in pieces if tuple(value.global_offset[: len(p.index)]) == p.index]
        assert len(at) == 1, (fqn, value.key, value.global_offset)
        out[fqn] = at[0].canonical[len("model.") :]
    return out


def _rank_fn(moe: bool, ep: int, steps: int, alone: bool) -> dict:
    out = _train_ours(moe, ep, steps)
    if alone:
        out["alone"] = _train_mcore_alone(moe, steps)
    return out


STEPS = 8


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each configuration once (the MCore-alone run inside the 1-rank launch)."""
    return {
        "dense1": run_ranks(_rank_fn, 1, False, 1, STEPS, True, timeout=240)[0],
        "dense2": run_ranks(_rank_fn, 2, False, 1, STEPS, False, timeout=240),
        "moe1": run_ranks(_rank_fn, 1, True, 1, STEPS, True, timeout=240)[0],
        "moe2": run_ranks(_rank_fn, 2, True, 2, STEPS, False, timeout=240),
    }


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_dense_one_and_two_ranks_agree(runs):
    one, two = runs["dense1"]["losses"], runs["dense2"][0]["losses"]
    assert len(one) == STEPS and one[-1] < one[0]  # it trains
    assert _rel(two, one) <= 1e-5, (one, two)


def test_moe_ep2_two_ranks_agree_with_one(runs):
    """EP 2 on 2 ranks against 1 rank: routing is per token and drop-free, the aux loss off, so
    only summation orders differ (the experts' gradients are summed over the expert-data-parallel
    group and divided by the world size). Measured: ~1e-7 relative; bound 1e-5."""
    one, two = runs["moe1"]["losses"], runs["moe2"][0]["losses"]
    assert one[-1] < one[0]
    assert _rel(two, one) <= 1e-5, (one, two)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_parity_with_megatron_core_own_training(runs, kind):
    """Our fully_shard (1 rank, and 2 ranks: EP 2 for MoE) against MCore's own unsharded training
    with the same init, data and Adam, over the first 5 steps (all 8 are compared)."""
    alone = runs[f"{kind}1"]["alone"]
    assert _rel(runs[f"{kind}1"]["losses"], alone) <= 1e-5, (runs[f"{kind}1"]["losses"], alone)
    assert _rel(runs[f"{kind}2"][0]["losses"], alone) <= 1e-5, (runs[f"{kind}2"][0]["losses"], alone)


@pytest.mark.parametrize("kind", ["dense1", "moe1", "moe2"])
def test_checkpoint_names_are_mcores_own(runs, kind):
    """Our name map equals MCore's sharded_state_dict's (keys map, layer and expert offsets) for
    every parameter; EP 2: each rank names its experts by their global index."""
    for rank_out in runs[kind] if isinstance(runs[kind], list) else [runs[kind]]:
        assert rank_out["names"] == rank_out["sharded"]
    if kind == "moe2":
        firsts = sorted(n for r in runs[kind] for *_, n in r["experts"])
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in firsts
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight2" in firsts


def test_experts_on_the_expert_data_parallel_group(runs):
    for rank_out in runs["moe2"]:
        assert rank_out["experts"] and all(
            g == EDP_GROUP and d == "dp" and size == 1 for g, d, size, _ in rank_out["experts"]
        )
    assert all(g == "dp" for g, *_ in runs["moe1"]["experts"])


def test_local_spec_keeps_nothing_beyond_parameters():
    """MCore's local spec: no buffers, every ``_extra_state`` None (so checkpoints of the
    parameters lose nothing); a buffer would be named."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = _build(True, 1)
    extra = [k for k in model.state_dict() if k.endswith("._extra_state")]
    assert extra and mcore.unsaved_state(model) == []
    model.decoder.register_buffer("counts", torch.zeros(3))
    assert mcore.unsaved_state(model) == ["decoder.counts"]


def test_legacy_grouped_mlp_refused():
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        mcore.expert_param("decoder.layers.0.mlp.experts.weight1")
    assert mcore.expert_param("decoder.layers.0.mlp.shared_experts.linear_fc1.weight") is None
    assert mcore.expert_param("mlp.experts.local_experts.3.linear_fc2.weight") == 3
    assert mcore.expert_param("mlp.experts.linear_fc1.weight5") == 5
