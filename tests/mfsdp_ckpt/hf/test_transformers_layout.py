"""The on-disk layout of ``transformers`` models (``mfsdp_ckpt.hf.transformers_layout``) is the one
transformers' own ``save_pretrained`` writes, tensor for tensor and bit for bit: fused experts
per expert, Mixtral's ``block_sparse_moe`` names, tied embeddings once. A transformers release
that changes its layout fails here, not in an export."""

from __future__ import annotations

import pytest
import torch
import transformers

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.files import HFDirectory
from mfsdp_ckpt.hf.transformers_layout import (
    check_weights,
    disk_layout,
    export_conversions,
    load_weights,
)
from tests.hf_models import CONFIGS, hf_config


def _model(family: str, seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(family))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_layout_is_what_save_pretrained_writes(family, tmp_path):
    model = _model(family)
    model.save_pretrained(tmp_path)
    params = dict(model.named_parameters())
    layout = disk_layout(model.config.model_type, {n: tuple(p.shape) for n, p in params.items()}, "test")
    with HFDirectory(tmp_path) as directory:
        ours = {piece.name: piece.shape for pieces in layout.values() for piece in pieces}
        assert ours == {k: tuple(t.shape) for k, t in directory.tensors.items()}
        for name, pieces in layout.items():
            for piece in pieces:
                assert torch.equal(piece.view(params[name].detach()), directory.read(piece.name)), piece.name
        check_weights(directory, layout, model.config.to_dict())
        fresh = _model(family, seed=4)
        fresh_params = {n: p.data for n, p in fresh.named_parameters()}
        load_weights(directory, layout, fresh_params)
    for name, p in params.items():
        assert torch.equal(fresh_params[name], p.detach()), name
    if family in ("mixtral", "qwen3_moe"):  # the fused experts really are split per expert on disk
        assert any(".experts.3." in k for k in ours) and not any(k.endswith("gate_up_proj") for k in ours)
    if family == "qwen3":
        assert "lm_head.weight" not in ours  # tied: once, as the embedding


def test_export_conversions_name_every_disk_tensor_once():
    model = _model("mixtral")
    shapes = {f"model.{n}": p.shape for n, p in model.named_parameters()}
    conversions = export_conversions("mixtral", shapes, "test")
    assert sorted(c.ours for c in conversions) == sorted(shapes)
    names = [n for c in conversions for n in c.theirs]
    assert len(names) == len(set(names))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


def test_fused_experts_of_an_unknown_family_are_refused_naming_it():
    with pytest.raises(
        ConversionError,
        match=r"where: model_type 'newmoe' keeps fused expert tensors "
        r"\(model.layers.0.mlp.experts.gate_up_proj\)",
    ):
        disk_layout("newmoe", {"model.layers.0.mlp.experts.gate_up_proj": (4, 8, 4)}, "where")
