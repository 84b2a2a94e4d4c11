"""Qwen3 (``Qwen3ForCausalLM``): dense, per-head q/k RMSNorm, no biases."""

from __future__ import annotations

from mfsdp_core.models.gpt import GPTConfig

from ..config import HFConfigReader, common_from_hf, common_to_hf, model_config
from ..mapping import Architecture, Direct, FusedQKV, GatedMLP, untied
from ._common import H, L, feature_problems

RULES = (
    Direct("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Direct(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),
    FusedQKV(L + "self_attention.linear_qkv.weight",
             (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight")),
    Direct(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"),
    Direct(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight"),
    Direct(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Direct(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight"),
    GatedMLP(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight")),
    Direct(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Direct("output_layer.weight", "lm_head.weight", when=untied),
)


def unsupported(c: GPTConfig) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=True, qkv_bias=False)


def to_hf_config(c: GPTConfig) -> dict:
    return {**common_to_hf(c, "qwen3", "Qwen3ForCausalLM"), "intermediate_size": c.ffn_hidden_size,
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.num_layers}


def from_hf_config(d: dict, source: str) -> GPTConfig:
    r = HFConfigReader(d, source, "qwen3")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.get("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    r.refuse(not r.get("use_sliding_window", False), "use_sliding_window=true (only full causal attention)")
    return model_config(r, {**kwargs, "ffn_hidden_size": int(r.get("intermediate_size")), "qk_layernorm": True})


ARCH = Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
