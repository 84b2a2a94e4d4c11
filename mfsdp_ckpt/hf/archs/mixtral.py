"""Mixtral (``MixtralForCausalLM``): MoE in every layer (softmax over all experts, top-k,
renormalised), experts ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down),
no shared expert, no biases, no q/k norms."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import EMBEDDING, HEAD, attention, feature_problems, moe_mlp, moe_problems
from mfsdp_ckpt.hf.config import (
    MAX_COUNT,
    HFConfigReader,
    common_from_hf,
    common_to_hf,
    model_config,
)
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

RULES = (
    EMBEDDING,
    *attention(),
    *moe_mlp("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1.weight", "w3.weight", "w2.weight"),
    *HEAD,
)


def unsupported(c: ModelShape) -> list[str]:
    return feature_problems(c, moe=True, qk_norm=False, qkv_bias=False) + moe_problems(c, renormalises_only=True)


def to_hf_config(c: ModelShape) -> dict:
    return {
        **common_to_hf(c, "mixtral", "MixtralForCausalLM"),
        "intermediate_size": c.moe_ffn_hidden_size,
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.moe_router_topk,
        "router_aux_loss_coef": c.moe_aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "mixtral")
    kwargs = common_from_hf(r, tie_default=False)
    window = r.integer("sliding_window", None, lo=0, hi=2**63 - 1)
    r.refuse(window is None or window >= kwargs["seq_length"], f"sliding_window={window} (only full causal attention)")
    jitter = r.number("router_jitter_noise", 0.0, lo=0.0)
    r.refuse(jitter == 0, f"router_jitter_noise={jitter} (our router has no jitter)")
    ffn = r.integer("intermediate_size")
    return model_config(
        r,
        {
            **kwargs,
            "ffn_hidden_size": ffn,
            "moe_ffn_hidden_size": ffn,
            "num_experts": r.integer(("num_local_experts", "num_experts"), 8, hi=MAX_COUNT),
            "moe_router_topk": r.integer("num_experts_per_tok", 2, hi=MAX_COUNT),
            "moe_score_func": "softmax",
            "moe_aux_loss_coeff": r.number("router_aux_loss_coef", 0.001, lo=0.0),
        },
    )


ARCH = Architecture("mixtral", "mixtral", "MixtralForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
