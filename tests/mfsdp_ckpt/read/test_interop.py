"""Stock PyTorch tools read our checkpoints, and stock DCP checkpoints with canonical keys load
into a sharded model."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import mfsdp_ckpt
from mfsdp_ckpt import UncommittedCheckpointError
from tests.mfsdp_ckpt.util import assemble, build, owned_pieces, shapes_of, train_steps
from tests.mfsdp_core.models import make_model, shard_model


def _save(path: str) -> dict:
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(path, model, optim, extra={"step": 2})
    return owned_pieces(model, optim)


def test_dcp_to_torch_save_yields_full_tensors_under_canonical_keys(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    truth = assemble(ranks(_save, 3, path, timeout=300), shapes_of())
    out = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, out)
    full = torch.load(out, weights_only=True)
    for key, tensor in truth.items():
        name = key.replace("main.", "model.", 1) if key.startswith("main.") else key
        assert torch.equal(full[name], tensor), key
    assert full["extra.step"] == 2
    groups = full["optim.param_groups"]
    assert sorted(p for g in groups for p in g["params"]) == sorted(shapes_of())
    assert groups[0]["lr"] == 1e-2 and groups[0]["weight_decay"] == 0.1


def _load_stock(path: str, require_manifest: bool) -> dict:
    model = shard_model(make_model("transformer", seed=3), strategy="optim_grads_params", policy="block(32)")
    try:
        mfsdp_ckpt.load(path, model, require_manifest=require_manifest)
    except UncommittedCheckpointError as e:
        return {"error": str(e)}
    return owned_pieces(model, None)


def test_stock_dcp_checkpoint_loads_into_sharded_model(ranks, tmp_path):
    source = make_model("transformer", seed=11)
    path = str(tmp_path / "stock")
    dcp.save({f"model.{n}": p.detach() for n, p in source.named_parameters()}, checkpoint_id=path, no_dist=True)
    # without a manifest it is refused unless asked for
    assert all("no committed manifest" in r["error"] for r in ranks(_load_stock, 3, path, True, timeout=300))
    expected = {n: p.detach().reshape(-1) for n, p in source.named_parameters()}
    for pieces in ranks(_load_stock, 3, path, False, timeout=300):
        for key, (lo, hi, values) in pieces.items():
            fqn = key.split(".", 1)[1]
            assert torch.equal(values, expected[fqn][lo:hi]), key
