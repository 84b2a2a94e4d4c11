"""Hugging Face export of a checkpoint trained with expert parallelism: every expert exactly once,
in the right place, whichever rank held it."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

import mfsdp_ckpt
from mfsdp_ckpt import hf
from mfsdp_core import (
    describe_shards,
    fully_shard,
    fully_shard_optimizer,
    refresh_compute_params,
)
from mfsdp_core.expert_parallel import expert_index, expert_placement, init_expert_mesh
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units

# Mixtral-style (no shared expert, which Mixtral cannot express), small
CONFIG = dataclasses.replace(
    get_preset("mixtral-like-small"),
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    moe_ffn_hidden_size=32,
    vocab_size=128,
    num_experts=8,
)


def _planted(layer: int, expert: int, which: str) -> float:
    """The value planted in every element of an expert's tensor: distinct per (layer, expert, which)."""
    return 100.0 * layer + expert + (0.25 if which == "linear_fc2" else 0.0)


def _train_plant_save(path: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_expert_mesh(4, CONFIG.num_experts)
    torch.manual_seed(0)
    model = shard_experts(GPTModel(CONFIG), mesh)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh.groups, placement=expert_placement())
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, CONFIG.vocab_size, (2 * world, 9), generator=torch.Generator().manual_seed(0))[
        2 * rank : 2 * rank + 2
    ]
    logits = model(tokens[:, :-1])
    (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) + model.aux_loss).backward()
    optim.step()
    held = []
    with torch.no_grad():
        for ps in describe_shards(model):
            found = expert_index(ps.fqn)
            if found is not None:
                layer = int(ps.fqn.split(".")[2])
                ps.main.tensor.fill_(_planted(layer, found[1], ps.fqn.split(".")[-2]))
                held.append(ps.fqn)
    refresh_compute_params(model)
    mfsdp_ckpt.save(path, model, optim, model_config=CONFIG.to_dict())
    return held


def test_export_of_an_ep_checkpoint_holds_every_expert_once_in_order(ranks, tmp_path):
    """W=4, EP=4 (2 of 8 experts per rank): a distinct value planted in each expert's tensors
    shows up, after export, in exactly that expert's Mixtral tensors, each once."""
    ckpt = tmp_path / "ckpt"
    held = ranks(_train_plant_save, 4, str(ckpt), timeout=300)
    assert sorted(n for names in held for n in names) == sorted(
        set(n for names in held for n in names)
    )  # each on one rank
    out = hf.export(str(ckpt), str(tmp_path / "hf"))
    with open(os.path.join(out.path, "model.safetensors.index.json")) as f:
        index = json.load(f)["weight_map"]
    names = []
    for file in sorted(set(index.values())):
        with safe_open(os.path.join(out.path, file), "pt") as f:
            names += list(f.keys())
    assert len(names) == len(set(names)) == len(index)
    ffn, hidden = CONFIG.moe_ffn_hidden_size, CONFIG.hidden_size
    for layer in range(CONFIG.num_layers):
        for e in range(CONFIG.num_experts):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            tensors = {}
            for which in ("w1", "w2", "w3"):
                key = prefix + which + ".weight"
                assert names.count(key) == 1, key
                with safe_open(os.path.join(out.path, index[key]), "pt") as f:
                    tensors[which] = f.get_tensor(key)
            fc1, fc2 = _planted(layer, e, "linear_fc1"), _planted(layer, e, "linear_fc2")
            assert tensors["w1"].shape == tensors["w3"].shape == (ffn, hidden)
            assert torch.all(tensors["w1"] == fc1) and torch.all(tensors["w3"] == fc1), (layer, e)
            assert tensors["w2"].shape == (hidden, ffn) and torch.all(tensors["w2"] == fc2), (layer, e)
