"""Megatron-Core ``torch_dist`` key layout ⇄ canonical keys: names and indices only (pure).

MCore stores a GPT model's transformer layers in one of two layouts:

- *stacked* (its default, when every layer is built from one spec): one DCP entry per kind of
  weight with a leading layer axis, ``decoder.layers.<rest>`` of shape ``(L, …)``; routed experts
  have a second axis, ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight`` of shape
  ``(L, E, …)``;
- *per layer* (MCore's ``non_homogeneous_layers``: what it writes when the layers differ, e.g.
  dense first layers then MoE ones with ``moe_layer_freq`` a list, as DeepSeek-V3): one entry per
  layer, ``decoder.layers.<i>.<rest>``, experts ``decoder.layers.<i>.mlp.experts.experts.
  linear_fc{1,2}.weight`` of shape ``(E, …)``.

Multi-token-prediction layers are always stored per layer: ``mtp.layers.<k>.{enorm, hnorm,
eh_proj, final_layernorm}.weight`` and ``mtp.layers.<k>.transformer_layer.<rest>`` (experts with
the expert axis, as above). Ours are per layer and per expert under ``model.`` (see
:mod:`mfsdp_ckpt.format.keys`); an MTP layer's transformer layer is layer ``num_layers + k`` of
the model for what depends on the layer (dense or MoE). A :class:`Piece` says which canonical
tensor is the slice ``stored[index]`` of which stored entry; a reader reads that slice alone and a
writer writes each canonical tensor as that one chunk of its entry.

Our canonical names are those of Transformer Engine's layer spec. MCore's local spec names some
norms otherwise, which depends on the layer (:class:`Naming`):

========================================================  ==================================================
local spec (MCore's own modules)                          canonical (Transformer Engine's spec)
========================================================  ==================================================
``mlp.linear_fc1.layer_norm_weight`` in an MoE layer       ``pre_mlp_layernorm.weight``
``pre_mlp_layernorm.weight`` in a dense layer (MLA spec)   ``mlp.linear_fc1.layer_norm_weight``
``self_attention.q_layernorm.weight`` (MLA)                ``self_attention.linear_q_up_proj.layer_norm_weight``
``self_attention.kv_layernorm.weight`` (MLA)               ``self_attention.linear_kv_up_proj.layer_norm_weight``
========================================================  ==================================================

(the first: the local spec's ``sharded_state_dict_keys_map`` names the pre-MLP norm after the
dense MLP's fused one in every layer; the MLA local spec has no keys map and keeps the norms as
separate modules). An import accepts both spellings; an export writes either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Piece",
    "Naming",
    "LayerView",
    "STACK",
    "EXPERTS",
    "MTP",
    "OPTIM_STATE",
    "OPTIM_DISTRIBUTED",
    "COMMON_STATE",
    "EXTRA_STATE",
    "naming_of",
    "model_pieces",
    "optimizer_pieces",
    "layer_view",
    "is_extra_state",
    "stack_of",
    "target_of",
    "extra_state_keys_of",
    "MOE_NORM_TE",
]

STACK = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts.experts."
MTP = "mtp.layers."
OPTIM_STATE = "optimizer.state."
OPTIM_DISTRIBUTED = "optimizer.distributed."
COMMON_STATE = "common_state"
EXTRA_STATE = "._extra_state"
MOE_NORM_TE = "decoder.layers.pre_mlp_layernorm.weight"
_OUR_MOE_NORM = "pre_mlp_layernorm.weight"
_DENSE_NORM = "mlp.linear_fc1.layer_norm_weight"
_STORED_EXPERTS = "mlp.experts.experts."
_TRANSFORMER_LAYER = "transformer_layer."
_EXPERT_WEIGHT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
#: MCore's local MLA spec names of the latent norms -> Transformer Engine's (ours)
_MLA_LOCAL = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_MLA_TE = {v: k for k, v in _MLA_LOCAL.items()}
#: MCore's optimizer state names -> ours (``param``: the fp32 main params)
STATE_NAMES = {"param": "main_param"}


@dataclass(frozen=True)
class Piece:
    """Canonical entry ``canonical`` is ``stored[index]``: ``index`` fixes the leading axes (the
    layer, the layer and the expert, or the expert; empty for an entry that is not stacked)."""

    canonical: str
    stored: str
    index: tuple[int, ...]


@dataclass(frozen=True)
class Naming:
    """What decides a layer's names: multi-latent attention or not, and which layers are MoE
    (those from ``first_moe`` on, counting MTP layers on from ``num_layers``; None: none)."""

    mla: bool = False
    first_moe: int | None = None
    num_layers: int = 0
    num_experts: int = 0

    def is_moe(self, layer: int) -> bool:
        return self.first_moe is not None and layer >= self.first_moe


def naming_of(cfg: Any) -> Naming:
    """The :class:`Naming` of a model shape (``ModelShape``)."""
    return Naming(
        mla=bool(cfg.multi_latent_attention),
        first_moe=cfg.first_k_dense_replace if cfg.num_experts else None,
        num_layers=cfg.num_layers,
        num_experts=cfg.num_experts,
    )


def _as_naming(naming: Naming | bool) -> Naming:
    """``naming``, or for a bool (``moe``: every layer MoE or none) the naming of such a model."""
    return naming if isinstance(naming, Naming) else Naming(first_moe=0 if naming else None)


def is_extra_state(key: str) -> bool:
    """A Transformer-Engine / MCore ``_extra_state`` object (``…._extra_state/shard_…``)."""
    return EXTRA_STATE + "/" in key or key.endswith(EXTRA_STATE)


# ---- stored -> canonical ------------------------------------------------------------------------


def _canonical_rest(rest: str, layer: int, naming: Naming) -> str:
    """Our name, inside layer ``layer``, of the tensor stored as ``rest`` (module docstring)."""
    if naming.mla:
        rest = _MLA_LOCAL.get(rest, rest)
    if naming.is_moe(layer):
        return _OUR_MOE_NORM if rest == _DENSE_NORM else rest
    return _DENSE_NORM if rest == _OUR_MOE_NORM else rest


def _expert_rest(rest: str, e: int) -> str:
    """``mlp.experts.experts.linear_fc1.weight`` of expert ``e`` -> ``mlp.experts.linear_fc1.weight<e>``."""
    base, _, leaf = rest[len(_STORED_EXPERTS) :].rpartition(".")
    return f"mlp.experts.{base}.{leaf}{e}"


#: (kind, layer, rest, index): where a canonical tensor lies, before the layer's naming applies;
#: kind ``decoder`` / ``mtp`` (``rest`` inside the layer / the MTP layer's transformer layer) or
#: None (``rest`` is the whole name)
_Slot = tuple[str | None, int, str, tuple[int, ...]]


def _slots(stored: str, shape: tuple[int, ...]) -> list[_Slot]:
    """The canonical tensors stored entry ``stored`` (global ``shape``) holds (see :data:`_Slot`)."""
    kind, layer, rest = None, 0, stored
    if (m := _LAYER_KEY.match(stored)) is not None:
        kind, layer, rest = "decoder", int(m.group(1)), m.group(2)
    elif (m := _MTP_KEY.match(stored)) is not None and m.group(2).startswith(_TRANSFORMER_LAYER):
        kind, layer, rest = "mtp", int(m.group(1)), m.group(2)[len(_TRANSFORMER_LAYER) :]
    elif stored.startswith(STACK):  # stacked: a leading layer axis (and an expert axis for experts)
        rest = stored[len(STACK) :]
        if rest.startswith(_STORED_EXPERTS):
            return [("decoder", i, _expert_rest(rest, e), (i, e)) for i in range(shape[0]) for e in range(shape[1])]
        return [("decoder", i, rest, (i,)) for i in range(shape[0])]
    if kind is not None and rest.startswith(_STORED_EXPERTS):
        return [(kind, layer, _expert_rest(rest, e), (e,)) for e in range(shape[0])]
    return [(kind, layer, rest, ())]


def _fqn(slot: _Slot, naming: Naming) -> str:
    kind, layer, rest, _ = slot
    if kind == "decoder":
        return f"{STACK}{layer}.{_canonical_rest(rest, layer, naming)}"
    if kind == "mtp":
        return f"{MTP}{layer}.{_TRANSFORMER_LAYER}{_canonical_rest(rest, naming.num_layers + layer, naming)}"
    return rest


def model_pieces(stored: str, shape: tuple[int, ...], naming: Naming | bool) -> list[Piece]:
    """The canonical ``model.*`` entries of stored model entry ``stored`` (global ``shape``);
    ``naming``: the model's :class:`Naming` (a bool: every layer MoE or none)."""
    naming = _as_naming(naming)
    return [Piece(f"model.{_fqn(s, naming)}", stored, s[3]) for s in _slots(stored, shape)]


def optimizer_pieces(stored: str, shape: tuple[int, ...], naming: Naming | bool) -> tuple[str, list[Piece]]:
    """``(state, pieces)`` of ``optimizer.state.<state>.<model key>`` (MCore's ``fully_reshardable``
    layout): the canonical ``optim.<fqn>.<state>`` entries, ``param`` named ``main_param``."""
    naming = _as_naming(naming)
    rest = stored[len(OPTIM_STATE) :]
    state, _, model = rest.partition(".")
    ours = STATE_NAMES.get(state, state)
    return state, [Piece(f"optim.{_fqn(s, naming)}.{ours}", stored, s[3]) for s in _slots(model, shape)]


@dataclass
class LayerView:
    """The stored decoder tensors seen as stacked whatever their layout: ``shapes[decoder.layers.<rest>]``
    is ``(layers holding it, *one layer's shape)`` (other entries as stored), ``layers[…]`` which
    layers hold it; ``mtp``: the MTP layers' indices. What the model config is inferred from."""

    shapes: dict[str, tuple[int, ...]]
    layers: dict[str, tuple[int, ...]]
    mtp: tuple[int, ...]
    per_layer: bool


def layer_view(shapes: dict[str, tuple[int, ...]]) -> LayerView:
    """The :class:`LayerView` of stored model entries ``shapes``. ValueError (one line) when the
    layouts are mixed or one kind of tensor has different shapes in different layers."""
    view: dict[str, tuple[int, ...]] = {}
    layers: dict[str, tuple[int, ...]] = {}
    per: dict[str, dict[int, tuple[int, ...]]] = {}
    mtp: set[int] = set()
    for key, shape in shapes.items():
        if (m := _LAYER_KEY.match(key)) is not None:
            per.setdefault(STACK + m.group(2), {})[int(m.group(1))] = tuple(shape)
        elif (m := _MTP_KEY.match(key)) is not None:
            mtp.add(int(m.group(1)))
        else:
            view[key] = tuple(shape)
            if key.startswith(STACK):
                layers[key] = tuple(range(shape[0]))
    stacked = sorted(layers)
    if per and stacked:
        raise ValueError(f"mixes stacked layers ('{stacked[0]}') and layers stored one by one ('{next(iter(per))}')")
    for key, by_layer in sorted(per.items()):
        kinds = sorted(set(by_layer.values()))
        if len(kinds) > 1:
            at = {s: min(i for i, v in by_layer.items() if v == s) for s in kinds}
            raise ValueError(
                f"'{key}' has different shapes in different layers: "
                + ", ".join(f"{list(s)} (layer {at[s]})" for s in kinds)
            )
        view[key] = (len(by_layer), *kinds[0])
        layers[key] = tuple(sorted(by_layer))
    return LayerView(view, layers, tuple(sorted(mtp)), bool(per))


# ---- canonical -> stored ------------------------------------------------------------------------


def _local_rest(rest: str, layer: int, naming: Naming) -> str:
    """MCore's local-spec name of our tensor ``rest`` of layer ``layer`` (module docstring)."""
    if naming.mla:
        rest = _MLA_TE.get(rest, rest)
        return _OUR_MOE_NORM if rest == _DENSE_NORM and not naming.is_moe(layer) else rest
    return _DENSE_NORM if rest == _OUR_MOE_NORM and naming.is_moe(layer) else rest


def target_of(
    fqn: str, naming: Naming, per_layer: bool, local: bool = False
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(stored key, index, leading dims)`` of our parameter ``fqn``: the entry it is the chunk
    ``index`` of, whose leading axes have sizes ``dims`` (``(L,)`` / ``(L, E)`` stacked, ``(E,)``
    for one layer's experts, ``()``). ``per_layer``: the decoder layers are stored one by one;
    ``local``: MCore's local-spec names (else Transformer Engine's, ours)."""
    if (m := _LAYER_KEY.match(fqn)) is not None:
        layer, rest = int(m.group(1)), m.group(2)
        at, prefix = layer, (f"{STACK}{layer}." if per_layer else None)
    elif (m := _MTP_KEY.match(fqn)) is not None and m.group(2).startswith(_TRANSFORMER_LAYER):
        layer, rest = int(m.group(1)), m.group(2)[len(_TRANSFORMER_LAYER) :]
        at, prefix = naming.num_layers + layer, f"{MTP}{layer}.{_TRANSFORMER_LAYER}"
    else:
        return fqn, (), ()
    if local:
        rest = _local_rest(rest, at, naming)
    e = _EXPERT_WEIGHT.match(rest)
    if prefix is None:
        if e is not None:
            return f"{EXPERTS}{e.group(1)}.weight", (layer, int(e.group(2))), (naming.num_layers, naming.num_experts)
        return STACK + rest, (layer,), (naming.num_layers,)
    if e is not None:
        return f"{prefix}{_STORED_EXPERTS}{e.group(1)}.weight", (int(e.group(2)),), (naming.num_experts,)
    return prefix + rest, (), ()


def stack_of(fqn: str, moe_norm: str = MOE_NORM_TE) -> tuple[str, tuple[int, ...]]:
    """The stacked entry and leading index of our parameter ``fqn`` in a model whose layers are
    all alike: ``decoder.layers.3.self_attention.linear_qkv.weight`` →
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


def _linear_modules(cfg: Any, layer: int) -> list[str]:
    """The linear modules of layer ``layer`` of model shape ``cfg``, but the routed experts'."""
    if cfg.multi_latent_attention:
        attention = ["linear_q_down_proj", "linear_q_up_proj"] if cfg.q_lora_rank else ["linear_q_proj"]
        attention += ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    else:
        attention = ["linear_qkv", "linear_proj"]
    modules = [f"self_attention.{m}" for m in attention]
    if not cfg.is_moe_layer(layer):
        modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
    elif cfg.moe_shared_expert_ffn_hidden_size:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    return modules


def _one_layer_extra_states(prefix: str, cfg: Any, layer: int) -> list[str]:
    keys = [f"{prefix}{m}{EXTRA_STATE}/shard_0_1" for m in _linear_modules(cfg, layer)]
    if cfg.is_moe_layer(layer):
        e_all = cfg.num_experts
        keys += [
            f"{prefix}{_STORED_EXPERTS}{fc}{EXTRA_STATE}/shard_{e}_{e_all}"
            for fc in ("linear_fc1", "linear_fc2")
            for e in range(e_all)
        ]
    return keys


def extra_state_keys_of(cfg: Any, per_layer: bool) -> list[str]:
    """The ``_extra_state`` objects MCore's loader asks for in a model of shape ``cfg`` built
    without Transformer Engine (MCore stores each as ``[None]``): one per linear module of
    attention and of the dense MLP (or the shared experts) of every layer, one per layer and
    expert for the experts' linears, and the MTP layers' (their ``eh_proj`` and their transformer
    layer's). Stacked layers: ``…<module>._extra_state/shard_<l>_<L>`` (experts
    ``shard_<l>.<e>_<L>.<E>``); per layer and in MTP layers: ``shard_0_1`` (experts
    ``shard_<e>_<E>``). (Checked against MCore 0.16.1 for dense, routed-expert and
    DeepSeek-V3-style models; 0.19.2 for the first two.)"""
    layers, experts = cfg.num_layers, cfg.num_experts
    keys = []
    if per_layer:
        for i in range(layers):
            keys += _one_layer_extra_states(f"{STACK}{i}.", cfg, i)
    else:
        for module in _linear_modules(cfg, 0):
            keys += [f"{STACK}{module}{EXTRA_STATE}/shard_{i}_{layers}" for i in range(layers)]
        if cfg.is_moe_layer(0):
            for fc in ("linear_fc1", "linear_fc2"):
                keys += [
                    f"{EXPERTS}{fc}{EXTRA_STATE}/shard_{i}.{e}_{layers}.{experts}"
                    for i in range(layers)
                    for e in range(experts)
                ]
    for k in range(cfg.mtp_num_layers):
        keys.append(f"{MTP}{k}.eh_proj{EXTRA_STATE}/shard_0_1")
        keys += _one_layer_extra_states(f"{MTP}{k}.{_TRANSFORMER_LAYER}", cfg, layers + k)
    return keys
