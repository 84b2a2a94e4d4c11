"""Qwen3 (``Qwen3ForCausalLM``): dense, per-head q/k RMSNorm, no biases."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import DENSE_MLP, EMBEDDING, HEAD, attention, feature_problems
from mfsdp_ckpt.hf.config import HFConfigReader, common_from_hf, common_to_hf, model_config
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

RULES = (EMBEDDING, *attention(qk_norm=True), *DENSE_MLP, *HEAD)


def unsupported(c: ModelShape) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=True, qkv_bias=False)


def to_hf_config(c: ModelShape) -> dict:
    return {
        **common_to_hf(c, "qwen3", "Qwen3ForCausalLM"),
        "intermediate_size": c.ffn_hidden_size,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.num_layers,
    }


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "qwen3")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.flag("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    r.refuse(not r.flag("use_sliding_window", False), "use_sliding_window=true (only full causal attention)")
    return model_config(r, {**kwargs, "ffn_hidden_size": r.integer("intermediate_size"), "qk_layernorm": True})


ARCH = Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
