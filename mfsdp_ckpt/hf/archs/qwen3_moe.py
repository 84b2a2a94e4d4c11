"""Qwen3-MoE (``Qwen3MoeForCausalLM``): MoE in every layer (softmax over all experts, top-k,
renormalised only with ``norm_topk_prob``), experts ``mlp.experts.{e}.gate_proj / up_proj /
down_proj``, per-head q/k RMSNorm, no shared expert, no biases."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import EMBEDDING, HEAD, attention, feature_problems, moe_mlp, moe_problems
from mfsdp_ckpt.hf.config import (
    MAX_COUNT,
    HFConfigReader,
    common_from_hf,
    common_to_hf,
    model_config,
)
from mfsdp_ckpt.hf.files import short_repr
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

RULES = (
    EMBEDDING,
    *attention(qk_norm=True),
    *moe_mlp("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    *HEAD,
)


def unsupported(c: ModelShape) -> list[str]:
    return feature_problems(c, moe=True, qk_norm=True, qkv_bias=False) + moe_problems(c, renormalises_only=False)


def to_hf_config(c: ModelShape) -> dict:
    return {
        **common_to_hf(c, "qwen3_moe", "Qwen3MoeForCausalLM"),
        "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.moe_router_topk,
        "norm_topk_prob": not c.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": c.moe_aux_loss_coeff,
        "output_router_logits": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "qwen3_moe")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.flag("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    r.refuse(not r.flag("use_sliding_window", False), "use_sliding_window=true (only full causal attention)")
    step = r.integer("decoder_sparse_step", 1, lo=0, hi=MAX_COUNT)
    r.refuse(step == 1, f"decoder_sparse_step={step} (our model has MoE in every layer)")
    dense_layers = r.integers("mlp_only_layers", [])
    r.refuse(not dense_layers, f"mlp_only_layers={short_repr(dense_layers)} (our model has MoE in every layer)")
    return model_config(
        r,
        {
            **kwargs,
            "ffn_hidden_size": r.integer("intermediate_size"),
            "moe_ffn_hidden_size": r.integer("moe_intermediate_size"),
            "num_experts": r.integer(("num_experts", "num_local_experts"), 128, hi=MAX_COUNT),
            "moe_router_topk": r.integer("num_experts_per_tok", 8, hi=MAX_COUNT),
            "moe_score_func": "softmax",
            "moe_router_pre_softmax": not r.flag("norm_topk_prob", False),
            "qk_layernorm": True,
            "moe_aux_loss_coeff": r.number("router_aux_loss_coef", 0.001, lo=0.0),
        },
    )


ARCH = Architecture("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
