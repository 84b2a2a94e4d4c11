"""Which transformers families keep their experts fused, and which have none: what the launcher
needs to refuse ``mfsdp-train --hf-model DIR --ep N`` from ``config.json`` alone, before it imports
torch or transformers (the ranks, which build the model, apply the same rule to what they built).

transformers 5 keeps each MoE layer's experts in two 3-D parameters (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``); :data:`FUSED_LAYOUTS` says, per family, what those experts are called
in a Hugging Face directory. Our expert parallelism places whole per-expert parameters, so such a
model trains with ``--ep 1`` (its experts sharded over all ranks like any parameter). The dense
families of :data:`DENSE_FAMILIES` declare no experts at all. tests/mfsdp_ckpt/hf/
test_expert_families.py checks both tables against the installed transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "FusedExperts",
    "FUSED_LAYOUTS",
    "FUSED_CLASSES",
    "DENSE_FAMILIES",
    "EXPERT_FIELDS",
    "fused_experts_refusal",
    "launcher_ep_refusal",
]


@dataclass(frozen=True)
class FusedExperts:
    """One model family's on-disk names for fused experts: the per-expert names of the gate half
    and the up half of ``gate_up_proj``, of ``down_proj``, and a rename of the module path."""

    gate: str
    up: str
    down: str
    rename: tuple[str, str] | None = None  # (in the module name, on disk), applied to the whole name


FUSED_LAYOUTS: dict[str, FusedExperts] = {
    "mixtral": FusedExperts("w1", "w3", "w2", rename=(".mlp.", ".block_sparse_moe.")),
    "qwen2_moe": FusedExperts("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": FusedExperts("gate_proj", "up_proj", "down_proj"),
}

#: the causal-LM class of each family of :data:`FUSED_LAYOUTS`
FUSED_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: dense families (model_type -> causal-LM class) whose configs declare no experts
DENSE_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
}

#: the expert counts the trainer reads from a transformers config, first set one first
EXPERT_FIELDS = ("num_local_experts", "num_experts")


def fused_experts_refusal(class_name: str) -> str:
    """Why ``--ep`` above 1 cannot train ``class_name``, a model with fused experts."""
    return (
        f"{class_name} keeps each MoE layer's experts fused in 3-D parameters (mlp.experts.gate_up_proj, "
        "mlp.experts.down_proj); expert parallelism places whole per-expert parameters, so train it with "
        "--ep 1 (the experts are then sharded over all ranks)"
    )


def _class_named(config: Mapping[str, Any], default: str) -> str | None:
    """The class the ranks will build: ``default`` unless ``architectures[0]`` names another (None:
    then transformers decides, not this table)."""
    archs = config.get("architectures")
    if archs is None or archs == []:
        return default
    if isinstance(archs, list) and archs[0] == default:
        return default
    return None


def launcher_ep_refusal(config: Mapping[str, Any], ep: int) -> str | None:
    """Why ``--ep ep`` cannot train the model of the transformers ``config`` (a checked
    ``config.json``), when the config alone says so: a family with fused experts, or a dense family
    that declares no experts. None: nothing to refuse here (the ranks decide the rest)."""
    if ep <= 1:
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    if model_type in FUSED_CLASSES:
        name = _class_named(config, FUSED_CLASSES[model_type])
        return fused_experts_refusal(name) if name else None
    if model_type in DENSE_FAMILIES and _class_named(config, DENSE_FAMILIES[model_type]):
        if not any(config.get(k) for k in EXPERT_FIELDS):
            return f"EP size {ep} needs a model with experts; this one has none"
    return None
