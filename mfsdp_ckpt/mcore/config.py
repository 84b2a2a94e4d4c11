"""The model shape (:data:`~mfsdp_ckpt.model.shape.ModelShape`) of an MCore checkpoint: what
the stored shapes determine, plus MCore's arguments for what they cannot.

The shapes fix the vocabulary, hidden size, layer count, FFN sizes, expert count, tied or untied
output, q/k norms and QKV bias; and, for the DeepSeek-V3 family (:mod:`.deepseek`), every
multi-latent-attention dimension, how many dense layers precede the MoE ones, the expert bias and
the MTP layers. They do not fix the attention heads of plain attention: the QKV rows are
``(heads + 2·groups)·kv_channels`` and the output projection's columns ``heads·kv_channels``, so
any one of ``num_attention_heads``, ``num_query_groups``, ``kv_channels`` gives the other two.
Nor do they fix the RoPE base (and YaRN's settings), the norm epsilon, the router's top-k, its
softmax order, groups and scaling factor, or the sequence length: these come from the arguments
given (``--config``, Megatron-LM's argument names; or the ``args`` Megatron-LM's trainer keeps in
the common state), else MCore's defaults, each of which is reported as assumed.

The shapes are read through :func:`~mfsdp_ckpt.mcore.layout.layer_view`: per-layer entries
(``decoder.layers.<i>.<rest>``) look like stacked ones, ``(layers holding it, …)``, and which
layers hold them is known.

A given argument that disagrees with a shape is refused in one line naming the argument and the
stored key; so is an argument our model cannot express (another normalisation, position
embedding, activation, a router scaling factor, …). Before any of this, the arguments pass
:func:`~mfsdp_ckpt.mcore.config_check.check_mcore_config` (types, ranges, choices, divisibility).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.mcore.config_check import check_mcore_config, read_mcore_args
from mfsdp_ckpt.mcore.deepseek import (
    KV_DOWN,
    PROJ,
    argument_fields,
    expert_bias_field,
    first_dense_layers,
    mcore_arguments,
    mla_fields,
    mtp_fields,
)
from mfsdp_ckpt.mcore.layout import EXPERTS, STACK
from mfsdp_ckpt.model.shape import ModelShape

__all__ = ["infer_config", "read_config_file", "to_mcore_args"]

QKV = STACK + "self_attention.linear_qkv.weight"
EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
DENSE_FC1 = STACK + "mlp.linear_fc1.weight"
DENSE_FC2 = STACK + "mlp.linear_fc2.weight"
ROUTER = STACK + "mlp.router.weight"
EXPERT_FC2 = EXPERTS + "linear_fc2.weight"
SHARED_FC2 = STACK + "mlp.shared_experts.linear_fc2.weight"
Q_NORM = STACK + "self_attention.q_layernorm.weight"
QKV_BIAS = STACK + "self_attention.linear_qkv.bias"

#: MCore's defaults for what shapes do not tell (Megatron-LM's argument names)
DEFAULTS = {
    "rotary_base": 10000,
    "norm_epsilon": 1e-5,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "seq_length": 4096,
}
#: arguments whose value our model must have (else it computes something else)
REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "normalization": ("RMSNorm",),
    "position_embedding_type": ("rope",),
    "swiglu": (True,),
    "rotary_percent": (1.0, 1),
    "rotary_interleaved": (False,),
    "add_bias_linear": (False,),
    "num_layers_per_virtual_pipeline_stage": (None,),
    "mrope_section": (None,),
    "rope_scaling": (False,),
    "moe_expert_capacity_factor": (None,),
    "moe_router_topk_limited_devices": (None,),
    "moe_shared_expert_gate": (False,),
    "moe_latent_size": (None,),
}
_ALIASES = {
    "layernorm_epsilon": "norm_epsilon",
    "padded_vocab_size": "vocab_size",
    "num_moe_experts": "num_experts",
    "max_position_embeddings": "seq_length",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_ffn_hidden_size",
}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of MCore arguments in ``path`` (a small local file), checked
    (:func:`~mfsdp_ckpt.mcore.config_check.read_mcore_args`)."""
    return read_mcore_args(path)


def _normalised(args: dict[str, Any]) -> dict[str, Any]:
    """Our spelling of Megatron-LM's argument names. Where both are given: ``padded_vocab_size``
    (the embedding's rows) over ``vocab_size`` (the tokenizer's), the larger of ``seq_length`` and
    ``max_position_embeddings`` (ours bounds the length a forward takes)."""
    out = {}
    for key, value in args.items():
        name = _ALIASES.get(key, key)
        if name not in out or key == name:
            out[name] = value
    if args.get("padded_vocab_size") is not None:
        out["vocab_size"] = args["padded_vocab_size"]
    lengths = [args[k] for k in ("seq_length", "max_position_embeddings") if isinstance(args.get(k), int)]
    if lengths:
        out["seq_length"] = max(lengths)
    return out


@dataclass(frozen=True)
class _Evidence:
    """What a config is inferred from: the stored shapes (``shapes(key)``: a stored tensor's global
    shape, None when absent) and the normalised arguments, with the two checks every field read
    from a shape goes through (so each error names the checkpoint or the arguments' origin)."""

    shapes: Callable[[str], tuple[int, ...] | None]
    args: dict[str, Any]
    source: str  # the checkpoint, named in errors about its shapes
    where: str  # where the arguments come from, named in errors about them
    held_by: Callable[[str], tuple[int, ...] | None] | None = None  # which layers hold a stacked key

    def layers(self, key: str) -> tuple[int, ...] | None:
        """The layers holding ``key`` (every layer of its stack unless told otherwise); None when absent."""
        shape = self.shapes(key)
        if shape is None:
            return None
        held = self.held_by(key) if self.held_by is not None else None
        return held if held is not None else tuple(range(shape[0]))

    def need(self, key: str) -> tuple[int, ...]:
        """The shape of ``key``, which every GPT model MCore saves has: its absence is refused."""
        shape = self.shapes(key)
        if shape is None:
            raise ConversionError(f"{self.source}: no key '{key}' (not a GPT model saved by Megatron-Core?)")
        return shape

    def agree(self, name: str, value: int, key: str) -> int:
        """``value`` (read from the shape of ``key``), refusing a given argument ``name`` that differs."""
        args = self.args
        if name in args and args[name] is not None and args[name] != value:
            raise ConversionError(
                f"{self.where}: {name}={args[name]!r} disagrees with the checkpoint: '{key}' has shape "
                f"{list(self.shapes(key) or ())} ({name}={value})"
            )
        return value


def _refuse_unsupported(args: dict[str, Any], where: str) -> None:
    """Refuse an argument our model cannot express: it would compute something else."""
    for name, allowed in REQUIRED_VALUES.items():
        if name in args and args[name] not in allowed:
            if name == "position_embedding_type" and args[name] == "none" and args.get("multi_latent_attention"):
                continue  # MLA applies its own RoPE (rope_type) whatever the model-level setting
            raise ConversionError(f"{where}: {name}={args[name]!r}: our model supports only {allowed[0]!r}")
    if args.get("moe_router_score_function", "softmax") not in ("softmax", "sigmoid"):
        raise ConversionError(
            f"{where}: moe_router_score_function={args['moe_router_score_function']!r}: only 'softmax' or 'sigmoid'"
        )
    balancing = args.get("moe_router_load_balancing_type")
    if balancing == "sinkhorn" or (isinstance(balancing, (list, tuple)) and "sinkhorn" in balancing):
        raise ConversionError(f"{where}: moe_router_load_balancing_type={balancing!r}: sinkhorn routing is not ours")


def _embedding_fields(ev: _Evidence) -> dict[str, int]:
    """Vocabulary and hidden size: the word embedding's rows and columns."""
    vocab, hidden = ev.need(EMBED)
    return {"vocab_size": ev.agree("vocab_size", vocab, EMBED), "hidden_size": ev.agree("hidden_size", hidden, EMBED)}


def _head_size(ev: _Evidence, qkv: tuple[int, ...], proj: tuple[int, ...]) -> int:
    """``kv_channels``: given, or from the heads or query groups given (the shapes fix only the
    products ``heads·kv_channels`` and ``2·groups·kv_channels``); refused when none is given."""
    cols, kv_total = proj[2], qkv[1] - proj[2]
    heads, groups, channels = (ev.args.get(n) for n in ("num_attention_heads", "num_query_groups", "kv_channels"))
    if ev.args.get("group_query_attention") is False and heads is not None and groups is None:
        groups = heads
    if channels is None and heads:
        channels = cols // heads
    if channels is None and groups:
        channels = kv_total // (2 * groups)
    if not channels:
        raise ConversionError(
            f"{ev.where}: num_attention_heads, num_query_groups or kv_channels is needed (the shapes of "
            f"'{QKV}' {list(qkv)} and '{PROJ}' {list(proj)} do not tell the head size): "
            f"give the config (import-mcore --config, export-hf --mcore-config)"
        )
    return channels


def _head_fields(ev: _Evidence, qkv: tuple[int, ...], proj: tuple[int, ...]) -> dict[str, int]:
    """Head size, head count and query groups: the QKV rows ``(heads + 2·groups)·kv_channels`` and
    the output projection's columns ``heads·kv_channels`` split by the head size, in whole heads."""
    cols, kv_total = proj[2], qkv[1] - proj[2]
    channels = _head_size(ev, qkv, proj)
    derived = {
        "kv_channels": channels,
        "num_attention_heads": cols // channels,
        "num_query_groups": kv_total // (2 * channels),
    }
    if cols % channels or kv_total % (2 * channels) or derived["num_query_groups"] <= 0:
        raise ConversionError(
            f"{ev.where}: kv_channels={channels} does not divide '{PROJ}' {list(proj)} and "
            f"'{QKV}' {list(qkv)} into whole heads"
        )
    for name, value in derived.items():
        ev.agree(name, value, QKV)
    if derived["num_attention_heads"] % derived["num_query_groups"]:
        raise ConversionError(
            f"{ev.where}: {derived['num_attention_heads']} heads are not a multiple of "
            f"{derived['num_query_groups']} query groups ('{QKV}' {list(qkv)})"
        )
    return derived


def _attention_fields(ev: _Evidence, hidden: int) -> dict[str, int]:
    """Layer count and the attention heads, from the stacked QKV and output projections (which
    must fit ``hidden``)."""
    qkv, proj = ev.need(QKV), ev.need(PROJ)
    layers = ev.agree("num_layers", qkv[0], QKV)
    if proj[:2] != (layers, hidden) or qkv[2] != hidden:
        raise ConversionError(
            f"{ev.source}: '{PROJ}' {list(proj)} and '{QKV}' {list(qkv)} do not fit hidden size {hidden}"
        )
    return {"num_layers": layers, **_head_fields(ev, qkv, proj)}


def _expert_count(ev: _Evidence) -> int:
    """The number of experts: the router's rows (0 without a router, where none may be given)."""
    router = ev.shapes(ROUTER)
    experts = router[1] if router else 0
    if router:
        ev.agree("num_experts", experts, ROUTER)
    if not router and ev.args.get("num_experts"):
        raise ConversionError(f"{ev.where}: num_experts={ev.args['num_experts']} but the checkpoint has no '{ROUTER}'")
    return experts


def _mlp_fields(ev: _Evidence, layers: int) -> dict[str, Any]:
    """Experts and FFN sizes (the experts', a dense MLP's, the shared experts'), how many dense
    layers precede the MoE ones and whether the routers have an expert bias; a dense MLP must be
    gated (SwiGLU), the only kind our model has."""
    experts = _expert_count(ev)
    moe_ffn = ffn = first_dense = 0
    out: dict[str, Any] = {}
    if experts:
        moe_ffn = ev.agree("moe_ffn_hidden_size", ev.need(EXPERT_FC2)[3], EXPERT_FC2)
        first_dense = first_dense_layers(ev, layers, ROUTER)
        out.update(expert_bias_field(ev))
    if not experts or first_dense:
        ffn = ev.agree("ffn_hidden_size", ev.need(DENSE_FC2)[2], DENSE_FC2)
        fc1 = ev.need(DENSE_FC1)
        if fc1[1] != 2 * ffn:
            raise ConversionError(
                f"{ev.source}: '{DENSE_FC1}' {list(fc1)} is not a gated (SwiGLU) projection of "
                f"2·{ffn} rows: our model has SwiGLU MLPs only"
            )
    else:
        ffn = ev.args.get("ffn_hidden_size") or moe_ffn
    shared = ev.shapes(SHARED_FC2)
    shared_ffn = ev.agree("moe_shared_expert_ffn_hidden_size", shared[2], SHARED_FC2) if shared else 0
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": moe_ffn,
        "ffn_hidden_size": ffn,
        "moe_shared_expert_ffn_hidden_size": shared_ffn,
        "first_k_dense_replace": first_dense,
        **out,
    }


def _presence_fields(ev: _Evidence, mla: bool) -> dict[str, bool]:
    """Tied output, q/k norms and QKV bias: whether their tensors are stored, refusing a given
    argument that says otherwise (with MLA, ``q_layernorm`` is the query latent's norm and
    ``qk_layernorm`` MCore's switch for the latent norms: :mod:`.deepseek` checks them)."""
    args = ev.args
    tied = ev.shapes(OUTPUT) is None
    if "untie_embeddings_and_output_weights" in args and bool(args["untie_embeddings_and_output_weights"]) == tied:
        raise ConversionError(
            f"{ev.where}: untie_embeddings_and_output_weights={args['untie_embeddings_and_output_weights']!r} "
            f"disagrees with the checkpoint ('{OUTPUT}' is {'absent' if tied else 'present'})"
        )
    if mla:
        return {"tie_embeddings": tied, "qk_layernorm": False, "add_qkv_bias": False}
    q_norm = ev.shapes(Q_NORM) is not None
    qkv_bias = ev.shapes(QKV_BIAS) is not None
    for name, present, key in (("qk_layernorm", q_norm, Q_NORM), ("add_qkv_bias", qkv_bias, QKV_BIAS)):
        if name in args and args[name] is not None and bool(args[name]) != present:
            raise ConversionError(
                f"{ev.where}: {name}={args[name]!r} disagrees with the checkpoint ('{key}' is "
                f"{'present' if present else 'absent'})"
            )
    return {"tie_embeddings": tied, "qk_layernorm": q_norm, "add_qkv_bias": qkv_bias}


def _shape_with_defaults(fields: dict[str, Any], args: dict[str, Any], where: str) -> tuple[ModelShape, list[str]]:
    """``(shape, assumed)``: the model shape of the ``fields`` the shapes fix, completed with the
    arguments the shapes do not tell, else MCore's defaults (``assumed``: those; the router's only
    for a MoE model; the DeepSeek family's: :func:`~mfsdp_ckpt.mcore.deepseek.argument_fields`)."""
    experts = fields["num_experts"]
    assumed = [name for name in DEFAULTS if name not in args and (experts or not name.startswith("moe_"))]
    value = {**DEFAULTS, **{k: v for k, v in args.items() if v is not None}}
    if fields.get("moe_router_enable_expert_bias") and args.get("moe_router_score_function") is None:
        value["moe_router_score_function"] = "sigmoid"  # MCore has an expert bias with sigmoid routing only
        assumed = [a for a in assumed if a != "moe_router_score_function"]
    sigmoid = value["moe_router_score_function"] == "sigmoid"  # MCore ignores moe_router_pre_softmax then
    try:
        more, more_assumed = argument_fields(value, fields, where)
        cfg = ModelShape(
            **fields,
            **more,
            rotary_base=float(value["rotary_base"]),
            norm_epsilon=float(value["norm_epsilon"]),
            moe_router_topk=int(value["moe_router_topk"]) if experts else 2,
            moe_score_func=str(value["moe_router_score_function"]),
            seq_length=int(value["seq_length"]),
            moe_router_pre_softmax=bool(value["moe_router_pre_softmax"]) if experts and not sigmoid else False,
            moe_aux_loss_coeff=float(value.get("moe_aux_loss_coeff", 1e-2)),
        )
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: {e}") from None
    return cfg, assumed + [a for a in more_assumed if a not in args]


def infer_config(
    shapes: Callable[[str], tuple[int, ...] | None],
    given: dict[str, Any],
    source: str,
    where: str,
    *,
    layers: Callable[[str], tuple[int, ...] | None] | None = None,
    mtp_layers: tuple[int, ...] = (),
) -> tuple[ModelShape, list[str]]:
    """``(config, assumed)``: the model shape (:data:`ModelShape`) from the stored shapes
    (``shapes(key)``: a stored tensor's global shape, stacked as in a
    :class:`~mfsdp_ckpt.mcore.layout.LayerView`, None when absent; ``layers(key)``: which layers
    hold it, default all of its stack; ``mtp_layers``: the MTP layers stored) and the MCore
    arguments ``given`` (read from ``where``, named in errors); ``assumed``: the arguments taken
    from MCore's defaults. Each group of fields is read, and checked against the arguments, in turn."""
    check_mcore_config(given, where)
    args = _normalised(given)
    _refuse_unsupported(args, where)
    ev = _Evidence(shapes, args, source, where, layers)
    fields: dict[str, Any] = dict(_embedding_fields(ev))
    mla = shapes(KV_DOWN) is not None
    if args.get("multi_latent_attention") and not mla:
        raise ConversionError(
            f"{where}: multi_latent_attention={args['multi_latent_attention']!r} disagrees with the checkpoint "
            f"(no '{KV_DOWN}')"
        )
    fields.update(mla_fields(ev, fields["hidden_size"]) if mla else _attention_fields(ev, fields["hidden_size"]))
    fields.update(_mlp_fields(ev, fields["num_layers"]))
    fields.update(_presence_fields(ev, mla))
    fields.update(mtp_fields(ev, mtp_layers))
    return _shape_with_defaults(fields, args, where)


def to_mcore_args(cfg: ModelShape, where: str = "model_config") -> dict[str, Any]:
    """The MCore (Megatron-LM) arguments of our config: what ``export-mcore`` writes next to a
    checkpoint (``mcore_args.json``) and what ``import-mcore --config`` reads back. A model it
    cannot describe (gated DeltaNet layers, …) is refused in one line naming ``where``."""
    deepseek = mcore_arguments(cfg, where)
    out: dict[str, Any] = {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "group_query_attention": cfg.num_query_groups != cfg.num_attention_heads,
        "kv_channels": cfg.kv_channels,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size,
        "seq_length": cfg.seq_length,
        "rotary_base": cfg.rotary_base,
        "norm_epsilon": cfg.norm_epsilon,
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "add_qkv_bias": cfg.add_qkv_bias,
        "qk_layernorm": cfg.qk_layernorm,
        "untie_embeddings_and_output_weights": not cfg.tie_embeddings,
    }
    if cfg.num_experts:
        out.update(
            num_experts=cfg.num_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_pre_softmax=cfg.moe_router_pre_softmax,
            moe_router_score_function=cfg.moe_score_func,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        )
        if cfg.moe_shared_expert_ffn_hidden_size:
            out["moe_shared_expert_intermediate_size"] = cfg.moe_shared_expert_ffn_hidden_size
    out.update(deepseek)
    return out
