"""Qwen2 (``Qwen2ForCausalLM``): dense, biases on q/k/v (none on o), no q/k norms."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import DENSE_MLP, EMBEDDING, HEAD, attention, feature_problems
from mfsdp_ckpt.hf.config import HFConfigReader, common_from_hf, common_to_hf, model_config
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

RULES = (EMBEDDING, *attention(qkv_bias=True), *DENSE_MLP, *HEAD)


def unsupported(c: ModelShape) -> list[str]:
    return feature_problems(c, moe=False, qk_norm=False, qkv_bias=True)


def to_hf_config(c: ModelShape) -> dict:
    return {
        **common_to_hf(c, "qwen2", "Qwen2ForCausalLM"),
        "intermediate_size": c.ffn_hidden_size,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.num_layers,
    }


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "qwen2")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.flag("use_sliding_window", False), "use_sliding_window=true (only full causal attention)")
    return model_config(r, {**kwargs, "ffn_hidden_size": r.integer("intermediate_size"), "add_qkv_bias": True})


ARCH = Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", RULES, unsupported, to_hf_config, from_hf_config)
