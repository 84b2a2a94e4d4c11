"""Llama (``LlamaForCausalLM``): dense, no biases, no q/k norms."""

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
    Direct(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Direct(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight"),
    GatedMLP(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight")),
    Direct(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Direct("output_layer.weight", "lm_head.weight", when=untied),
)


def unsupported(c: GPTConfig) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=False, qkv_bias=False)


def to_hf_config(c: GPTConfig) -> dict:
    return {**common_to_hf(c, "llama", "LlamaForCausalLM"), "intermediate_size": c.ffn_hidden_size,
            "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def from_hf_config(d: dict, source: str) -> GPTConfig:
    r = HFConfigReader(d, source, "llama")
    kwargs = common_from_hf(r, tie_default=False)
    # Llama's attention_bias also puts a bias on o_proj, which our model does not have
    r.refuse(not r.get("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    r.refuse(not r.get("mlp_bias", False), "mlp_bias=true")
    return model_config(r, {**kwargs, "ffn_hidden_size": int(r.get("intermediate_size"))})


ARCH = Architecture("llama", "llama", "LlamaForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
