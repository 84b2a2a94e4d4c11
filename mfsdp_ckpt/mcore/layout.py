"""Megatron-Core ``torch_dist`` key layout ⇄ canonical keys: names and indices only (pure).

MCore stores a GPT model's transformer layers *stacked*: one DCP entry per kind of weight with a
leading layer axis, ``decoder.layers.<rest>`` of shape ``(L, …)``; routed experts have a second
axis, ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight`` of shape ``(L, E, …)``. Ours
are per layer and per expert under ``model.`` (see :mod:`mfsdp_ckpt.format.keys`). A :class:`Piece`
says which canonical tensor is the slice ``stored[index]`` of which stored entry; a reader reads
that slice alone and a writer writes each canonical tensor as that one chunk of the stack.

Two spellings of one weight are accepted: the MoE pre-MLP norm is
``decoder.layers.pre_mlp_layernorm.weight`` under Transformer Engine's layer spec and
``decoder.layers.mlp.linear_fc1.layer_norm_weight`` under MCore's local spec (in an MoE model;
in a dense one that name is the norm fused into the dense MLP's first projection).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Piece",
    "STACK",
    "EXPERTS",
    "OPTIM_STATE",
    "OPTIM_DISTRIBUTED",
    "COMMON_STATE",
    "EXTRA_STATE",
    "model_pieces",
    "optimizer_pieces",
    "is_extra_state",
    "stored_name",
    "stack_of",
    "extra_state_keys",
    "MOE_NORM_TE",
    "MOE_NORM_LOCAL",
]

STACK = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts.experts."
OPTIM_STATE = "optimizer.state."
OPTIM_DISTRIBUTED = "optimizer.distributed."
COMMON_STATE = "common_state"
EXTRA_STATE = "._extra_state"
MOE_NORM_TE = "decoder.layers.pre_mlp_layernorm.weight"
MOE_NORM_LOCAL = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
_OUR_MOE_NORM = "pre_mlp_layernorm.weight"
_EXPERT_WEIGHT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
#: MCore's optimizer state names -> ours (``param``: the fp32 main params)
STATE_NAMES = {"param": "main_param"}


@dataclass(frozen=True)
class Piece:
    """Canonical entry ``canonical`` is ``stored[index]``: ``index`` fixes the leading axes (the
    layer, or the layer and the expert; empty for an entry that is not stacked)."""

    canonical: str
    stored: str
    index: tuple[int, ...]


def is_extra_state(key: str) -> bool:
    """A Transformer-Engine / MCore ``_extra_state`` object (``…._extra_state/shard_…``)."""
    return EXTRA_STATE + "/" in key or key.endswith(EXTRA_STATE)


def _fqn_pieces(stored: str, shape: tuple[int, ...], moe: bool, canonical_of) -> list[Piece]:
    if stored.startswith(EXPERTS):
        rest = stored[len(EXPERTS) :]
        layers, experts = shape[0], shape[1]
        base, _, leaf = rest.rpartition(".")
        return [
            Piece(canonical_of(f"decoder.layers.{layer}.mlp.experts.{base}.{leaf}{e}"), stored, (layer, e))
            for layer in range(layers)
            for e in range(experts)
        ]
    if stored.startswith(STACK):
        rest = stored[len(STACK) :]
        if moe and stored == MOE_NORM_LOCAL:
            rest = _OUR_MOE_NORM
        return [Piece(canonical_of(f"decoder.layers.{layer}.{rest}"), stored, (layer,)) for layer in range(shape[0])]
    return [Piece(canonical_of(stored), stored, ())]


def model_pieces(stored: str, shape: tuple[int, ...], moe: bool) -> list[Piece]:
    """The canonical ``model.*`` entries of stored model entry ``stored`` (global ``shape``);
    ``moe``: the model has routed experts (decides what ``mlp.linear_fc1.layer_norm_weight`` is)."""
    return _fqn_pieces(stored, shape, moe, lambda fqn: f"model.{fqn}")


def optimizer_pieces(stored: str, shape: tuple[int, ...], moe: bool) -> tuple[str, list[Piece]]:
    """``(state, pieces)`` of ``optimizer.state.<state>.<model key>`` (MCore's ``fully_reshardable``
    layout): the canonical ``optim.<fqn>.<state>`` entries, ``param`` named ``main_param``."""
    rest = stored[len(OPTIM_STATE) :]
    state, _, model = rest.partition(".")
    ours = STATE_NAMES.get(state, state)
    pieces = _fqn_pieces(model, shape, moe, lambda fqn: f"optim.{fqn}.{ours}")
    return state, [Piece(p.canonical, stored, p.index) for p in pieces]


def stack_of(fqn: str, moe_norm: str = MOE_NORM_TE) -> tuple[str, tuple[int, ...]]:
    """The stored entry and leading index of our parameter ``fqn`` (the inverse of
    :func:`model_pieces`): ``decoder.layers.3.self_attention.linear_qkv.weight`` →
    (``decoder.layers.self_attention.linear_qkv.weight``, (3,)); an expert weight
    ``…layers.3.mlp.experts.linear_fc1.weight5`` → (``…experts.experts.linear_fc1.weight``, (3, 5)).
    ``moe_norm``: the name to give the MoE pre-MLP norm (TE spec by default)."""
    if not fqn.startswith(STACK):
        return fqn, ()
    layer, _, rest = fqn[len(STACK) :].partition(".")
    m = _EXPERT_WEIGHT.match(rest)
    if m:
        return f"{EXPERTS}{m.group(1)}.weight", (int(layer), int(m.group(2)))
    if rest == _OUR_MOE_NORM:
        return moe_norm, (int(layer),)
    return STACK + rest, (int(layer),)


def stored_name(fqn: str) -> str:
    """The stored entry of our parameter ``fqn`` (see :func:`stack_of`)."""
    return stack_of(fqn)[0]


def extra_state_keys(num_layers: int, num_experts: int, dense: bool, shared_experts: bool = False) -> list[str]:
    """The ``_extra_state`` objects MCore's loader asks for in a model without Transformer
    Engine (MCore stores each as ``[None]``): one per layer for every linear module of attention
    and of the dense MLP (or the shared experts), one per layer and expert for the experts'
    linears. (Checked against MCore 0.16 / 0.19 for dense and routed-expert models; the shared
    experts' entries follow the same rule but no genuine checkpoint with them was made.)"""
    keys = []
    modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if dense:
        modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
    if shared_experts:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    for module in modules:
        keys += [f"{STACK}{module}{EXTRA_STATE}/shard_{layer}_{num_layers}" for layer in range(num_layers)]
    if num_experts:
        for fc in ("linear_fc1", "linear_fc2"):
            keys += [
                f"{EXPERTS}{fc}{EXTRA_STATE}/shard_{layer}.{e}_{num_layers}.{num_experts}"
                for layer in range(num_layers)
                for e in range(num_experts)
            ]
    return keys
