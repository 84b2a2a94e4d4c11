"""Checkpoints of expert-parallel models: experts are stored under their global names, so a
checkpoint saved at (world size W, EP size E) loads at any other (W', E') bitwise, online and
after an offline ``reshard --ep``; a resumed run continues bitwise; bad input is refused in one
line and changes nothing; ``inspect`` shows which EP rank held which experts.

A small MoE GPT with 12 experts (divisible by 1, 2, 3 and 4) is trained 3 AdamW steps at
(4, 4), so every expert and its optimizer state (exp_avg, exp_avg_sq, step) is distinct."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.diff import diff_checkpoints
from mfsdp_ckpt.inspect import inspect_checkpoint, verify_checkpoint
from mfsdp_ckpt.streaming import CheckpointBuilder, CheckpointReader
from mfsdp_core import ModelPlan, describe_shards, fully_shard, fully_shard_optimizer
from mfsdp_core.expert_parallel import expert_placement, init_expert_mesh
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = dataclasses.replace(get_preset("tiny-moe"), num_experts=12, moe_ffn_hidden_size=32,
                          moe_shared_expert_ffn_hidden_size=32, seq_length=16)
FC1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
STEPS = 3  # trained before the save
MORE = 2  # trained after it (resume)


# ---- helpers run on every rank ----------------------------------------------------------------

def build(ep: int, seed: int = 0, config=CFG, strategy: str = "optim_grads_params", policy: str = "even"):
    """The MoE GPT at EP size ``ep`` over the current world (no process group: one rank), with
    its adapted AdamW."""
    mesh = init_expert_mesh(ep, config.num_experts)
    torch.manual_seed(seed)
    model = shard_experts(GPTModel(config), mesh)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh.groups, placement=expert_placement(policy), strategy=strategy)
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def train(model, optim, start: int, stop: int) -> list[float]:
    """Steps ``start`` .. ``stop - 1``; rank r trains on its own 2 sequences of each step (the
    same at every EP size for a given world size). Returns the losses."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) + model.aux_loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def pieces(model, optim) -> dict[str, tuple]:
    """Canonical key -> (shape, start, end, values) of the range this rank owns: weights, main
    params, per-element optimizer state; scalar optimizer state (AdamW's step) as (None, 0, 0,
    value)."""
    out = {}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        out[f"model.{ps.fqn}"] = (ps.shape, lo, hi, ps.param.tensor[lo - ps.param.start: hi - ps.param.start].clone())
        out[f"main.{ps.fqn}"] = (ps.shape, lo, hi, ps.main.tensor.clone())
        for name, fs in ps.optim.items():
            out[f"optim.{ps.fqn}.{name}"] = (ps.shape, lo, hi, fs.tensor.clone())
        for name, value in ps.optim_extra.items():
            out[f"optim.{ps.fqn}.{name}"] = (None, 0, 0, value.clone() if isinstance(value, torch.Tensor) else value)
    return out


def state_of(model, optim) -> dict[str, torch.Tensor]:
    """Everything this rank holds, to check that a failed load changed nothing."""
    out = {f"{k}": v[3] for k, v in pieces(model, optim).items()}
    out.update({f"group{g}.{k}": torch.tensor(float(v)) for g, group in enumerate(optim.param_groups)
                for k, v in group.items() if isinstance(v, (int, float))})
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---- in the test process ----------------------------------------------------------------------

def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full logical tensors from every rank's owned pieces; each element covered exactly once;
    scalar state equal on every rank that holds it."""
    full: dict[str, torch.Tensor] = {}
    keys = sorted({k for p in per_rank for k in p})
    for key in keys:
        held = [p[key] for p in per_rank if key in p]
        shape = held[0][0]
        if shape is None:
            values = [h[3] for h in held]
            assert all(torch.equal(v, values[0]) for v in values), key
            full[key] = values[0]
            continue
        flat = torch.full((shape.numel(),), float("nan"), dtype=held[0][3].dtype)
        seen = torch.zeros(shape.numel(), dtype=torch.int32)
        for _, lo, hi, values in held:
            flat[lo:hi] = values
            seen[lo:hi] += 1
        assert bool((seen == 1).all()), f"{key}: elements covered {seen.min().item()}..{seen.max().item()} times"
        full[key] = flat.view(shape)
    return full


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: keys differ: {sorted(set(got) ^ set(expected))[:6]}"
    differ = [k for k in expected if expected[k].dtype != got[k].dtype or not torch.equal(expected[k], got[k])]
    assert not differ, f"{what}: {len(differ)} entries differ, e.g. {differ[:4]}"


# ---- the source checkpoint: (4, 4), 3 steps ----------------------------------------------------

def _train_and_save(root: str) -> dict:
    """At (4, 4): 3 steps, save, then 2 more steps without interruption (the resume reference)."""
    model, optim = build(4)
    train(model, optim, 0, STEPS)
    mfsdp_ckpt.save(os.path.join(root, "src"), model, optim, extra={"step": STEPS}, step=STEPS)
    saved = pieces(model, optim)
    losses = train(model, optim, STEPS, STEPS + MORE)
    return {"saved": saved, "end": pieces(model, optim), "losses": losses}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("ep"))
    out = run_ranks(_train_and_save, 4, root, timeout=300)
    return {"path": os.path.join(root, "src"), "root": root, "saved": assemble([o["saved"] for o in out]),
            "end": [o["end"] for o in out], "losses": [o["losses"] for o in out]}


def test_manifest_records_every_expert_and_who_held_it(source):
    with CheckpointReader(source["path"]) as reader:
        writer = reader.manifest["writer"]
        groups = reader.read("optim.param_groups")
        keys = reader.keys()
    assert writer["world_size"] == 4
    assert writer["experts"] == {"ep_size": 4, "owners": [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]}
    plan = ModelPlan.from_dict(writer["plan"])
    names = set(plan.params())
    assert {f"{FC1}{e}" for e in range(12)} <= names  # every expert of every EP rank, once
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == names
    experts = [b for b in plan.buffers if b.is_expert]
    assert len(experts) == 2 * 4 and all(b.placement.group == "edp" and b.group_size == 1 and b.grad_divisor == 4 for b in experts)
    layer0 = [b for b in plan.buffers if b.prefix == "decoder.layers.0."]
    assert [b.is_expert for b in layer0] == [False, True, True, True, True]
    assert layer0[2].names == tuple(f"mlp.experts.linear_fc{i}.weight{e}" for i in (1, 2) for e in (3, 4, 5))
    # the optimizer's groups name every parameter of every rank
    assert len(groups) == 1 and set(groups[0]["params"]) == names


def test_resume_at_the_same_layout_is_bitwise(ranks, source):
    out = ranks(_resume, 4, source["path"], timeout=300)
    for rank, (o, losses, end) in enumerate(zip(out, source["losses"], source["end"])):
        assert o["losses"] == losses, rank
        assert sorted(o["end"]) == sorted(end)
        for key, (shape, lo, hi, values) in end.items():
            got = o["end"][key]
            assert got[1:3] == (lo, hi) and torch.equal(got[3], values), (rank, key)


def _resume(path: str) -> dict:
    model, optim = build(4, seed=5)  # other weights: the load must replace them
    extra = mfsdp_ckpt.load(path, model, optim)
    losses = train(model, optim, extra["step"], STEPS + MORE)
    return {"losses": losses, "end": pieces(model, optim)}


# ---- online: load at other (W, EP), save there, load back at (4, 4) -----------------------------

def _load_and_save(root: str, ep: int) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, optim = build(ep, seed=7)
    extra = mfsdp_ckpt.load(os.path.join(root, "src"), model, optim)
    mfsdp_ckpt.save(os.path.join(root, f"w{world}_ep{ep}"), model, optim, extra=extra, update_latest=False)
    return pieces(model, optim)


def _at_4_1_then_back_to_4_4(root: str, others: list[str]) -> dict:
    out = {"w4_ep1": _load_and_save(root, 1)}
    for name in [*others, "w4_ep1"]:
        model, optim = build(4, seed=9)
        mfsdp_ckpt.load(os.path.join(root, name), model, optim)
        out[f"back_from_{name}"] = pieces(model, optim)
    return out


@pytest.mark.heavy
def test_load_at_other_ep_sizes_and_back(ranks, source):
    root, expected = source["root"], source["saved"]
    at = {"w2_ep2": assemble(ranks(_load_and_save, 2, root, 2, timeout=300)),
          "w3_ep3": assemble(ranks(_load_and_save, 3, root, 3, timeout=300)),
          "w1_ep1": assemble([_load_and_save(root, 1)])}  # no process group
    back = ranks(_at_4_1_then_back_to_4_4, 4, root, ["w2_ep2", "w3_ep3", "w1_ep1"], timeout=300)
    at["w4_ep1"] = assemble([b["w4_ep1"] for b in back])
    for name, full in at.items():
        assert_same(expected, full, f"loaded at {name}")
        assert_same(expected, assemble([b[f"back_from_{name}"] for b in back]), f"saved at {name}, loaded at (4, 4)")
    for name, ep in (("w2_ep2", 2), ("w3_ep3", 3), ("w1_ep1", 1), ("w4_ep1", 1)):
        with CheckpointReader(os.path.join(root, name)) as reader:
            n = 12 // ep
            assert reader.manifest["writer"]["experts"] == {"ep_size": ep, "owners": [list(range(p * n, (p + 1) * n)) for p in range(ep)]}
        assert diff_checkpoints(source["path"], os.path.join(root, name)).equal, name
