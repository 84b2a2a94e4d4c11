"""Llama (``LlamaForCausalLM``): dense, no biases, no q/k norms."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import DENSE_MLP, EMBEDDING, HEAD, attention, feature_problems
from mfsdp_ckpt.hf.config import HFConfigReader, common_from_hf, common_to_hf, model_config
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

RULES = (EMBEDDING, *attention(), *DENSE_MLP, *HEAD)


def unsupported(c: ModelShape) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=False, qkv_bias=False)


def to_hf_config(c: ModelShape) -> dict:
    return {
        **common_to_hf(c, "llama", "LlamaForCausalLM"),
        "intermediate_size": c.ffn_hidden_size,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "llama")
    kwargs = common_from_hf(r, tie_default=False)
    # Llama's attention_bias also puts a bias on o_proj, which our model does not have
    r.refuse(not r.flag("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    r.refuse(not r.flag("mlp_bias", False), "mlp_bias=true")
    return model_config(r, {**kwargs, "ffn_hidden_size": r.integer("intermediate_size")})


ARCH = Architecture("llama", "llama", "LlamaForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
