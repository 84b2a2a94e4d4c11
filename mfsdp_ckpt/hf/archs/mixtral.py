"""Mixtral (``MixtralForCausalLM``): MoE in every layer (softmax over all experts, top-k,
renormalised), experts ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down),
no shared expert, no biases, no q/k norms."""

from __future__ import annotations

from mfsdp_core.models.gpt import GPTConfig

from ..config import HFConfigReader, common_from_hf, common_to_hf, model_config
from ..mapping import Architecture, Direct, FusedQKV, GatedMLP, untied
from ._common import H, L, feature_problems, moe_problems

RULES = (
    Direct("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Direct(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),
    FusedQKV(L + "self_attention.linear_qkv.weight",
             (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight")),
    Direct(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Direct(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    Direct(L + "mlp.router.weight", H + "block_sparse_moe.gate.weight"),
    GatedMLP(L + "mlp.experts.linear_fc1.weight{e}",
             (H + "block_sparse_moe.experts.{e}.w1.weight", H + "block_sparse_moe.experts.{e}.w3.weight")),
    Direct(L + "mlp.experts.linear_fc2.weight{e}", H + "block_sparse_moe.experts.{e}.w2.weight"),
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Direct("output_layer.weight", "lm_head.weight", when=untied),
)


def unsupported(c: GPTConfig) -> list[str]:
    return feature_problems(c, moe=True, qk_norm=False, qkv_bias=False) + moe_problems(c, renormalises_only=True)


def to_hf_config(c: GPTConfig) -> dict:
    return {**common_to_hf(c, "mixtral", "MixtralForCausalLM"), "intermediate_size": c.moe_ffn_hidden_size,
            "num_local_experts": c.num_experts, "num_experts_per_tok": c.moe_router_topk,
            "router_aux_loss_coef": c.moe_aux_loss_coeff, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def from_hf_config(d: dict, source: str) -> GPTConfig:
    r = HFConfigReader(d, source, "mixtral")
    kwargs = common_from_hf(r, tie_default=False)
    window = r.get("sliding_window", None)
    r.refuse(window is None or window >= kwargs["seq_length"], f"sliding_window={window} (only full causal attention)")
    jitter = r.get("router_jitter_noise", 0.0)
    r.refuse(jitter == 0, f"router_jitter_noise={jitter} (our router has no jitter)")
    ffn = int(r.get("intermediate_size"))
    return model_config(r, {
        **kwargs, "ffn_hidden_size": ffn, "moe_ffn_hidden_size": ffn,
        "num_experts": int(r.get("num_local_experts", r.get("num_experts", 8))),
        "moe_router_topk": int(r.get("num_experts_per_tok", 2)), "moe_score_func": "softmax",
        "moe_aux_loss_coeff": float(r.get("router_aux_loss_coef", 0.001)),
    })


ARCH = Architecture("mixtral", "mixtral", "MixtralForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
