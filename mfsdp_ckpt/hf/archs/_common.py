"""Key prefixes and the checks shared by the architecture modules."""

from __future__ import annotations

from mfsdp_core.models.gpt import GPTConfig

#: canonical layer prefix (``model.`` is added by :func:`mfsdp_ckpt.hf.mapping.expand`)
L = "decoder.layers.{i}."
#: HF layer prefix
H = "model.layers.{i}."


def feature_problems(c: GPTConfig, *, moe: bool, qk_norm: bool, qkv_bias: bool) -> list[str]:
    """What in ``c`` differs from an architecture that has MoE layers (or not), q/k norms (or
    not) and q/k/v biases (or not): those are fixed by the architecture, not configurable."""
    out = []
    if moe and c.num_experts == 0:
        out.append("a dense model (num_experts=0); this architecture has MoE layers")
    if not moe and c.num_experts > 0:
        out.append(f"MoE layers (num_experts={c.num_experts}); this architecture is dense")
    if c.qk_layernorm != qk_norm:
        out.append(f"qk_layernorm={c.qk_layernorm}; this architecture {'always has' if qk_norm else 'has no'} q/k norms")
    if c.add_qkv_bias != qkv_bias:
        out.append(f"add_qkv_bias={c.add_qkv_bias}; this architecture {'always has' if qkv_bias else 'has no'} q/k/v biases")
    return out


def moe_problems(c: GPTConfig, *, renormalises_only: bool) -> list[str]:
    """Router features our MoE layers have and these HF MoE blocks lack."""
    out = []
    if c.num_experts == 0:
        return out
    if c.moe_shared_expert_ffn_hidden_size > 0:
        out.append(f"a shared expert (moe_shared_expert_ffn_hidden_size={c.moe_shared_expert_ffn_hidden_size})")
    if c.moe_score_func != "softmax":
        out.append(f"moe_score_func={c.moe_score_func!r} (only softmax routing)")
    if renormalises_only and c.moe_router_pre_softmax:
        out.append("moe_router_pre_softmax=True (this router always renormalises the top-k weights)")
    return out
