"""``rename_params``: checkpoint names that differ from module paths (Megatron-Core's local spec
needs it). The plan, the shard description and a checkpoint all carry the new names, a load at
another world size finds them, and a rename that leaves its unit or merges two names is refused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import mfsdp_ckpt
from mfsdp_core import describe_shards, fully_shard_optimizer, plan_of, rename_params
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps

# the Transformer test model's block: its attention norm named as a fused norm of the QKV linear
_RENAMES = {
    "block.attn_norm.weight": "block.qkv.layer_norm_weight",
    "block.attn_norm.bias": "block.qkv.layer_norm_bias",
}


def _rename(fqn: str) -> str:
    return _RENAMES.get(fqn, fqn)


def _build(strategy: str = "optim_grads_params", policy: str = "even"):
    model = shard_model(make_model("transformer"), strategy=strategy, policy=policy)
    rename_params(model, _rename)
    return model, fully_shard_optimizer(make_adamw(model.parameters()))


def _save_renamed(path: str) -> dict:
    model, optim = _build()
    train_steps(model, optim, 0, 2)
    names = sorted(ps.fqn for ps in describe_shards(model, optim))
    plan = sorted(n for b in plan_of(model).to_dict()["buffers"] for n in b["params"])
    mfsdp_ckpt.save(path, model, optim, extra={"step": 2})
    return {
        "names": names,
        "plan": plan,
        "state": {ps.fqn: ps.main.tensor.clone() for ps in describe_shards(model, optim)},
    }


def _load_renamed(path: str) -> dict:
    model, optim = _build(strategy="optim", policy="row")
    mfsdp_ckpt.load(path, model, optim)
    return {ps.fqn: (ps.owned, ps.main.tensor.clone()) for ps in describe_shards(model, optim)}


def test_renamed_params_save_and_load_at_another_world_size(ranks, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = ranks(_save_renamed, 3, ckpt)
    assert "block.qkv.layer_norm_weight" in saved[0]["names"] and "block.attn_norm.weight" not in saved[0]["names"]
    assert saved[0]["plan"] == saved[0]["names"]
    full = str(tmp_path / "full.pt")
    dcp_to_torch_save(ckpt, full)
    keys = torch.load(full, weights_only=True).keys()
    assert "model.block.qkv.layer_norm_weight" in keys and "model.block.attn_norm.weight" not in keys
    loaded = ranks(_load_renamed, 2, ckpt)
    # the loaded main params equal the saved ones, name by name, across the two layouts
    stored = torch.load(full, weights_only=True)
    for per_rank in loaded:
        for fqn, ((lo, hi), main) in per_rank.items():
            assert torch.equal(main, stored[f"model.{fqn}"].flatten()[lo:hi]), fqn


def test_rename_that_leaves_its_unit_or_merges_names_is_refused():
    model = shard_model(make_model("transformer"), strategy="no_shard")
    with pytest.raises(ValueError, match=r"'block.fc1.weight' to 'fc1.weight' leaves its unit 'block'"):
        rename_params(model, lambda n: "fc1.weight" if n == "block.fc1.weight" else n)
    with pytest.raises(ValueError, match=r"would both be named 'block.fc2.weight'"):
        rename_params(model, lambda n: "block.fc2.weight" if n == "block.fc1.weight" else n)
    assert "block.fc1.weight" in [n for b in plan_of(model).to_dict()["buffers"] for n in b["params"]]  # unchanged
