"""What part of a model a checkpoint key belongs to (embeddings, attention, MLP, experts, norms,
LoRA adapters) and which layer, from its name alone: the rows of the model table of ``inspect
--html`` and of the summary of ``diff --html``; and which *part* of the training state it is (the
weights, one optimizer state such as ``exp_avg``, an MXFP8 plane), so that the diff page never
puts an Adam moment, a step counter and a weight into one maximum.

Names are those of our reference GPT (Megatron-Core's spelling: ``decoder.layers.3.self_attention
.linear_qkv.weight``), of Megatron-Core's own checkpoints, and of ``transformers`` models
(``model.layers.3.self_attn.q_proj.weight``, ``block_sparse_moe.experts``, ``mlp.gate``).
"""

from __future__ import annotations

import re

from mfsdp_ckpt.format.keys import group_of, mx_plane_of

__all__ = ["KINDS", "param_kind", "layer_of", "param_name", "part_of", "part_order", "is_lora_factor", "WEIGHTS"]

#: the kinds, in the order tables list them
KINDS = ("embeddings", "attention", "MLP", "experts", "norms", "LoRA adapters", "other")
#: the part of the state a ``model.*`` key is
WEIGHTS = "weights"
#: parts in the order tables list them (others after them, by name): the weights, their gradients,
#: the optimizer's fp32 main params and moments, MXFP8 planes
_PART_ORDER = (WEIGHTS, "gradients", "main_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
#: the plane names of an MXFP8 weight differ only by direction: one part per kind of plane
_MX_DIRECTIONS = ("rowwise_", "columnwise_")

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")
_EMBEDDING = {
    "embed_tokens",
    "embedding",
    "embeddings",
    "word_embeddings",
    "position_embeddings",
    "wte",
    "wpe",
    "lm_head",
    "output_layer",
    "embed_in",
    "embed_out",
}
_EXPERTS = {"experts", "local_experts", "router", "gate", "shared_experts", "shared_expert", "shared_expert_gate"}
_MLP = {"mlp", "feed_forward", "ffn", "gate_proj", "up_proj", "down_proj", "c_fc", "dense_h_to_4h", "dense_4h_to_h"}


def param_name(key: str) -> str:
    """The parameter a key is about: ``model.X`` / ``grad.X`` -> X, ``optim.X.exp_avg`` -> X,
    ``mx.X.plane`` -> X, ``optimizer.state.exp_avg.X`` (Megatron-Core) -> X; else the key."""
    group = group_of(key)
    if group in ("model", "grad"):
        return key.split(".", 1)[1]
    if group == "optim":
        return key.split(".", 1)[1].rsplit(".", 1)[0]
    if group == "mx":
        found = mx_plane_of(key)
        return found[0] if found else key
    if key.startswith("optimizer.state.") and key.count(".") >= 3:
        return key.split(".", 3)[3]
    return key


def param_kind(key: str) -> str:
    """One of :data:`KINDS` for a key (or a bare parameter name), from its dotted segments: a
    LoRA factor (``lora_A``, ``lora_B``) first, then norms (a fused ``linear_qkv.layer_norm_weight``
    is a norm), embeddings and the output head, routed experts and their router, attention, the
    dense MLP; else ``other``."""
    if is_lora_factor(key):
        return "LoRA adapters"
    parts = param_name(key).lower().split(".")
    if any("norm" in p or p.startswith("ln_") or p == "ln" for p in parts):
        return "norms"
    if any(p in _EMBEDDING for p in parts):
        return "embeddings"
    if any(p in _EXPERTS or p.endswith("expert_bias") or p == "e_score_correction_bias" for p in parts):
        return "experts"
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if any(p in _MLP or p.startswith("linear_fc") for p in parts):
        return "MLP"
    return "other"


def layer_of(key: str) -> int | None:
    """The layer index in a key (``...layers.3...``), or None for what sits outside the layers."""
    found = _LAYER.search(param_name(key))
    return int(found.group(1)) if found else None


def is_lora_factor(key: str) -> bool:
    """Whether the key is (the state of) a LoRA factor: ``....q_proj.lora_A.weight``."""
    return any(p in ("lora_A", "lora_B") for p in param_name(key).split("."))


def part_of(key: str) -> str:
    """Which part of the training state a key is: ``weights`` (``model.*``), ``gradients``, the
    optimizer state's name (``exp_avg``, ``step``; Megatron-Core's ``optimizer.state.exp_avg.X``
    too), ``mx data`` / ``mx scale`` for MXFP8 planes (rowwise and columnwise together), else
    ``other`` (``extra.*``, objects)."""
    group = group_of(key)
    if group == "model":
        return WEIGHTS
    if group == "grad":
        return "gradients"
    if group == "optim" and key.count(".") >= 2:
        return key.rsplit(".", 1)[1]
    if group == "mx" and (found := mx_plane_of(key)):
        plane = found[1]
        for direction in _MX_DIRECTIONS:
            plane = plane.removeprefix(direction)
        return f"mx {plane}"
    if key.startswith("optimizer.state.") and key.count(".") >= 3:
        return key.split(".")[2]
    return "other"


def part_order(part: str) -> tuple[int, int, str]:
    """The sort key of a part: the weights, gradients, main params and moments first, then any
    other optimizer state by name, the MXFP8 planes, and ``other`` last."""
    if part in _PART_ORDER:
        return 0, _PART_ORDER.index(part), ""
    if part.startswith("mx "):
        return 2, 0, part
    return (3 if part == "other" else 1), 0, part
