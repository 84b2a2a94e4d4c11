"""Qwen2 (``Qwen2ForCausalLM``): dense, biases on q/k/v (none on o), no q/k norms."""

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
    FusedQKV(L + "self_attention.linear_qkv.bias",
             (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias")),
    Direct(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Direct(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight"),
    GatedMLP(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight")),
    Direct(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Direct("output_layer.weight", "lm_head.weight", when=untied),
)


def unsupported(c: GPTConfig) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=False, qkv_bias=True)


def to_hf_config(c: GPTConfig) -> dict:
    return {**common_to_hf(c, "qwen2", "Qwen2ForCausalLM"), "intermediate_size": c.ffn_hidden_size,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}


def from_hf_config(d: dict, source: str) -> GPTConfig:
    r = HFConfigReader(d, source, "qwen2")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.get("use_sliding_window", False), "use_sliding_window=true (only full causal attention)")
    return model_config(r, {**kwargs, "ffn_hidden_size": int(r.get("intermediate_size")), "add_qkv_bias": True})


ARCH = Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
