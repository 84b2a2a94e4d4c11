"""Runtime support for Hugging Face ``transformers`` causal LMs (``*ForCausalLM``) under
``fully_shard``: which modules become units, how their parameters are placed, which weights
``--mxfp8`` may store as MXFP8, and one forward that gives logits and an aux loss.

Nothing here imports ``transformers``: the functions read the module tree the way every
``*ForCausalLM`` of transformers 5 builds it (a base model holding ``layers``, an ``nn.ModuleList``
of decoder layers; ``nn.Linear`` projections; MoE layers whose experts are fused 3-D parameters
``mlp.experts.gate_up_proj`` ``(E, 2F, H)`` and ``mlp.experts.down_proj`` ``(E, H, F)``, and whose
router is a plain ``weight`` ``(E, H)``). Parameters keep their HF names (``named_parameters()``,
tied embeddings once), so checkpoint keys are ``model.<HF module fqn>``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mfsdp_core.plan import PlacementFn, placement_fn

__all__ = ["decoder_layers", "shard_units", "placement", "linear_weights", "causal_lm_forward"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM: the ``nn.ModuleList`` named ``layers`` in its
    base model (``model.model.layers`` for Llama, Qwen, Mixtral, ...). ValueError when there is none
    (not a decoder-only transformers model)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    found = [
        (name, m)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(m, nn.ModuleList)
    ]
    if len(found) == 1 and len(found[0][1]) > 0:
        return found[0][1]
    raise ValueError(f"{type(model).__name__}: no decoder layers found (expected one nn.ModuleList named 'layers')")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules to ``fully_shard``, inner first: each decoder layer, then the root (which takes
    the embedding, the final norm and the output layer, tied or not)."""
    return [*decoder_layers(model), model]


def placement(policy: str) -> PlacementFn:
    """The placement of every parameter: ``policy`` over the data-parallel group, experts (the fused
    ``…experts.gate_up_proj`` / ``…experts.down_proj``, whose names hold ``experts.``) in buffers
    of their own, as ``fully_shard``'s default does. Under ``block(k)`` a fused expert tensor's rows
    are its experts (dimension 0), so an expert count that ``k`` does not divide is refused by the
    layout, naming the parameter."""
    return placement_fn(None, policy)


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The decoder layers' ``nn.Linear`` weights (attention q/k/v/o, dense MLP and shared-expert
    projections): what ``--mxfp8`` stores as MXFP8. Not the routers (one row per expert, and not
    ``nn.Linear`` in transformers 5), the fused 3-D expert tensors (MXFP8 marks 2-D weights), norms,
    the embedding or the output layer."""
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for layer in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                out.append(module.weight)
    return out


def causal_lm_forward(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [b, s]`` -> (fp32 logits ``[b, s, V]``, aux loss). No KV cache, no router logits:
    the aux loss is a zero scalar. transformers' MoE load-balancing loss is a product of
    per-batch token fractions and mean router probabilities, a non-linear function of the batch a
    rank holds, so its gradient would change with the world size; it is left out (the config's
    ``router_aux_loss_coef`` has no effect here), which keeps training DP-invariant."""
    kwargs: dict[str, Any] = {"input_ids": tokens, "use_cache": False}
    if getattr(getattr(model, "config", None), "output_router_logits", None) is not None:
        kwargs["output_router_logits"] = False
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float(), torch.zeros((), device=logits.device, dtype=torch.float32)
