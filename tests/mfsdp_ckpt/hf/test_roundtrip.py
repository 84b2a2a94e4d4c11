"""HF model (built by ``transformers``) -> ``import_`` -> ``export`` gives bitwise the same
tensors in the same dtype, and ``transformers`` loads the export and computes the same logits as
our reference model on the imported weights, for every architecture and the shapes that stress
the mapping: GQA ratios 1, 2 and 4, head_dim != hidden/heads, tied and untied embeddings, q/k/v
biases, MoE top-1 and top-2 with and without renormalised router weights.

Logit tolerance 1e-5 (fp32): both sides compute the same math but not in the same operation order
(SDPA vs. HF's attention, our fused QKV matmul vs. three matmuls, expert accumulation order), so
they agree to rounding (measured ~1e-7), not bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from mfsdp_ckpt import hf
from mfsdp_ckpt.model.shape import default_plan
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core import ModelPlan
from mfsdp_core.models.gpt import GPTConfig

from .util import (
    hf_config,
    hf_tensors,
    random_hf_model,
    reference_model,
    save_hf,
    tokens,
)

LOGIT_ATOL = 1e-5

CASES = {
    # name: (arch, config overrides)
    "llama-gqa1-headdim16-untied": ("llama", dict(num_key_value_heads=4, head_dim=16)),
    "llama-gqa2-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-gqa4-headdim4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4)),
    "qwen2-gqa4-bias-untied": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2-gqa1-bias-tied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-gqa2-headdim8-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-gqa4-headdim16": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
    "mixtral-top2": ("mixtral", dict()),
    "mixtral-top1-headdim16": ("mixtral", dict(num_experts_per_tok=1, head_dim=16, num_key_value_heads=4)),
    "qwen3_moe-top2-norm": ("qwen3_moe", dict()),
    "qwen3_moe-top1-nonorm-tied": (
        "qwen3_moe",
        dict(num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True),
    ),
    "qwen3_moe-top2-nonorm-gqa4": (
        "qwen3_moe",
        dict(norm_topk_prob=False, num_attention_heads=8, num_key_value_heads=2),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_export_bitwise_and_transformers_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    source = random_hf_model(hf_config(arch, **overrides), seed=len(case))
    src = save_hf(source, str(tmp_path / "src"), max_shard_size="40KB")  # several input shards
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))

    imported = hf.import_(src, tmp_path / "ckpt")
    assert imported.architecture == arch
    with CheckpointReader(tmp_path / "ckpt") as reader:  # the trainer's buffers, for reshard
        plan = ModelPlan.from_dict(reader.manifest["writer"]["plan"])
        assert plan.buffers and plan == default_plan(GPTConfig.from_dict(reader.manifest["model_config"]))
    exported = hf.export(tmp_path / "ckpt", tmp_path / "out", max_shard_size="30KB")
    assert exported.architecture == arch and len(exported.files) > 1

    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "out"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(a) and set(index["weight_map"].values()) == set(exported.files)

    ours = reference_model(str(tmp_path / "ckpt"))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == type(source).__name__
    x = tokens()
    with torch.no_grad():
        ours_logits, their_logits, source_logits = ours(x), theirs(x).logits, source(x).logits
    assert torch.equal(their_logits, source_logits)  # the export is the same model as the source
    err = (ours_logits - their_logits).abs().max().item()
    assert err <= LOGIT_ATOL, err


def test_bfloat16_round_trip_is_bitwise_and_dtype_preserved(tmp_path):
    source = random_hf_model(hf_config("qwen2"), dtype=torch.bfloat16)
    src = save_hf(source, str(tmp_path / "src"))
    hf.import_(src, tmp_path / "ckpt")
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert {reader.dtype(k) for k in reader.keys() if k.startswith("model.")} == {torch.bfloat16}
    hf.export(tmp_path / "ckpt", tmp_path / "out")
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "out"))
    assert sorted(a) == sorted(b)
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_dtype_casts_every_tensor(tmp_path):
    source = random_hf_model(hf_config("mixtral"))
    src = save_hf(source, str(tmp_path / "src"))
    hf.import_(src, tmp_path / "ckpt")
    hf.export(tmp_path / "ckpt", tmp_path / "out", dtype="bfloat16")
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "out"))
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)


def test_single_file_and_config_round_trip(tmp_path):
    """An unsharded HF directory imports; the exported config.json carries the same model, which
    transformers reads back as the same config values."""
    from transformers import AutoConfig

    config = hf_config("qwen3_moe", norm_topk_prob=False)
    src = save_hf(random_hf_model(config), str(tmp_path / "src"))
    assert os.path.isfile(os.path.join(src, "model.safetensors"))
    result = hf.import_(src, tmp_path / "ckpt")
    assert result.model_config["moe_router_pre_softmax"] is True and result.model_config["qk_layernorm"] is True
    hf.export(tmp_path / "ckpt", tmp_path / "out")
    back = AutoConfig.from_pretrained(str(tmp_path / "out"))
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(back, field) == getattr(config, field), field
    assert (
        back.num_experts == config.num_experts
        and back.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    )
    # the re-import of the export gives the same model config
    assert hf.import_(str(tmp_path / "out"), tmp_path / "ckpt2").model_config == result.model_config
