"""The one check every set of Megatron-Core (Megatron-LM) arguments passes before anything is
built or written: ``import-mcore --config`` and ``export-hf --mcore-config`` files, the ``args``
an MCore checkpoint's ``common.pt`` carries, ``mfsdp-train --mcore-config`` files and the MCore
arguments a checkpoint's ``model_source`` records. Torch-free, so the launcher can run it before
any rank starts (:func:`check_mcore_config_file`).

What :func:`check_mcore_config` refuses, in one line naming where the arguments come from and the
argument: a known argument of the wrong JSON type (a string, list or object where a number is
expected, ``true`` for a count: booleans are not integers here), an integer outside its bounds
(:data:`INT_RANGES`: positive where a size, below generous ceilings no real model reaches), a
number that is not finite or outside its range (:data:`FLOAT_RANGES`: ``rotary_base`` > 0,
``norm_epsilon`` in (0, 1), ``rotary_percent`` in (0, 1], ...), a choice outside its set
(:data:`CHOICES`), and sizes that do not divide (``hidden_size`` by ``num_attention_heads`` when
no ``kv_channels`` is given, heads by query groups, the router's top-k and groups by the experts,
an odd RoPE head size). ``None`` is Megatron-LM's "not set" and passes; unknown names are not
read by import-mcore and pass (a dump of Megatron-LM's whole ``args`` works).

Sizes: :func:`estimate_parameters` gives a lower bound of a model's parameter count from its shape
fields (:func:`shape_fields` of MCore arguments); an import compares it with the elements the
checkpoint's tensors hold (:func:`check_against_tensors`), a fresh model with the machine's memory
(:func:`check_fits_memory`), before any model is built.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from mfsdp_ckpt.errors import ConversionError, one_line
from mfsdp_ckpt.hf.config_check import machine_memory
from mfsdp_ckpt.read.resolve import read_small_file

__all__ = [
    "MAX_CONFIG_BYTES",
    "INT_RANGES",
    "FLOAT_RANGES",
    "CHOICES",
    "read_mcore_args",
    "check_mcore_config",
    "check_mcore_config_file",
    "shape_fields",
    "estimate_parameters",
    "check_against_tensors",
    "check_fits_memory",
]

MAX_CONFIG_BYTES = 1 << 20  # a Megatron-LM args dump is ~20 KB
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # hidden and FFN sizes, latent ranks
MAX_HEADS = 1 << 14  # heads, query groups, per-head dimensions
MAX_VOCAB = 1 << 24
MAX_SEQ = 1 << 24
MAX_EXPERTS = 1 << 14

#: integer arguments: (least, most); Megatron-LM's and our model config's spellings
INT_RANGES: dict[str, tuple[int, int]] = {
    "num_layers": (1, MAX_LAYERS),
    "hidden_size": (1, MAX_WIDTH),
    "num_attention_heads": (1, MAX_HEADS),
    "num_query_groups": (1, MAX_HEADS),
    "kv_channels": (1, MAX_HEADS),
    "ffn_hidden_size": (1, MAX_WIDTH),
    "vocab_size": (1, MAX_VOCAB),
    "padded_vocab_size": (1, MAX_VOCAB),
    "seq_length": (1, MAX_SEQ),
    "max_position_embeddings": (1, MAX_SEQ),
    "num_experts": (0, MAX_EXPERTS),
    "num_moe_experts": (0, MAX_EXPERTS),
    "moe_router_topk": (1, MAX_EXPERTS),
    "moe_ffn_hidden_size": (0, MAX_WIDTH),
    "moe_shared_expert_intermediate_size": (0, MAX_WIDTH),
    "moe_shared_expert_ffn_hidden_size": (0, MAX_WIDTH),
    "moe_router_num_groups": (0, MAX_EXPERTS),
    "moe_router_group_topk": (0, MAX_EXPERTS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "q_lora_rank": (0, MAX_WIDTH),
    "kv_lora_rank": (0, MAX_WIDTH),  # 0: our config's "no multi-latent attention"
    "qk_head_dim": (0, MAX_HEADS),
    "qk_pos_emb_head_dim": (0, MAX_HEADS),
    "v_head_dim": (0, MAX_HEADS),
    "original_max_position_embeddings": (0, MAX_SEQ),
    "mtp_num_layers": (0, 64),
}
#: number arguments (an integer or a finite float): (least, most, least excluded, most excluded)
FLOAT_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "rotary_base": (0.0, 1e15, True, False),
    "norm_epsilon": (0.0, 1.0, True, True),
    "layernorm_epsilon": (0.0, 1.0, True, True),
    "rotary_percent": (0.0, 1.0, True, False),
    "moe_aux_loss_coeff": (0.0, 1e6, False, False),
    "moe_router_topk_scaling_factor": (0.0, 1e6, True, False),
    "moe_router_bias_update_rate": (0.0, 1e6, False, False),
    "rotary_scaling_factor": (0.0, 1e6, True, False),
    "beta_fast": (0.0, 1e6, True, False),
    "beta_slow": (0.0, 1e6, True, False),
    "mscale": (0.0, 1e6, False, False),
    "mscale_all_dim": (0.0, 1e6, False, False),
    "mtp_loss_scaling_factor": (0.0, 1e6, False, False),
    "init_method_std": (0.0, 1e3, False, False),
    "hidden_dropout": (0.0, 1.0, False, False),
    "attention_dropout": (0.0, 1.0, False, False),
}
BOOLEANS = (
    "swiglu",
    "untie_embeddings_and_output_weights",
    "tie_embeddings",
    "qk_layernorm",
    "add_qkv_bias",
    "group_query_attention",
    "multi_latent_attention",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "add_bias_linear",
    "rotary_interleaved",
    "rope_scaling",
    "moe_shared_expert_gate",
    "moe_grouped_gemm",
)
#: arguments that name one of a few things (which of them our model computes: mcore.config)
CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": ("RMSNorm", "LayerNorm"),
    "position_embedding_type": ("rope", "none", "learned_absolute", "relative", "mrope", "yarn"),
    "moe_router_score_function": ("softmax", "sigmoid"),
    "moe_score_func": ("softmax", "sigmoid"),
    "rope_type": ("rope", "yarn"),
}
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def _shown(value: Any) -> str:
    """``value`` as an error shows it: its repr, on one line and short."""
    text = " ".join(repr(value).split())  # a tensor's repr spans lines
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def read_mcore_args(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """The JSON object of MCore arguments in the file ``path`` (at most :data:`MAX_CONFIG_BYTES`),
    checked (:func:`check_mcore_config`); errors name ``where`` (default: the path)."""
    path = os.fspath(path)
    where = where or path
    text = read_small_file(path, "config")
    if len(text) > MAX_CONFIG_BYTES:
        raise ConversionError(f"{where}: {len(text)} bytes, more than the {MAX_CONFIG_BYTES} an MCore config may have")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else one_line(e, 120)
        raise ConversionError(f"{where}: not JSON ({what})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{where}: expected a JSON object of MCore arguments, got {type(value).__name__}")
    check_mcore_config(value, where)
    return value


def _check_int(name: str, value: Any, where: str) -> None:
    least, most = INT_RANGES[name]
    if not _is_int(value):
        raise ConversionError(f"{where}: {name}={_shown(value)}: expected an integer")
    if not least <= value <= most:
        raise ConversionError(f"{where}: {name}={_shown(value)}: expected an integer in [{least}, {most}]")


def _check_number(name: str, value: Any, where: str) -> None:
    least, most, open_low, open_high = FLOAT_RANGES[name]
    if (
        not _is_number(value)
        or not (value > least if open_low else value >= least)
        or not (value < most if open_high else value <= most)
    ):
        span = f"{'(' if open_low else '['}{least:g}, {most:g}{')' if open_high else ']'}"
        raise ConversionError(f"{where}: {name}={_shown(value)}: expected a finite number in {span}")


def _check_choice(name: str, value: Any, where: str) -> None:
    if name == "moe_router_load_balancing_type":
        items = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, str) and v in LOAD_BALANCING for v in items):
            raise ConversionError(
                f"{where}: {name}={_shown(value)}: expected one of {', '.join(LOAD_BALANCING)} (or a list of them)"
            )
    elif not isinstance(value, str) or value not in CHOICES[name]:
        raise ConversionError(f"{where}: {name}={_shown(value)}: expected one of {', '.join(CHOICES[name])}")


def _check_layer_freq(value: Any, args: Mapping[str, Any], where: str) -> None:
    """``moe_layer_freq``: every how many layers one is MoE (an integer), or a 0 / 1 per layer."""
    layers = args.get("num_layers")
    if _is_int(value) and 1 <= value <= MAX_LAYERS:
        return
    if isinstance(value, list) and all(_is_int(v) and v in (0, 1) for v in value):
        if not _is_int(layers) or len(value) == layers:
            return
        raise ConversionError(f"{where}: moe_layer_freq has {len(value)} entries for num_layers={layers}")
    raise ConversionError(
        f"{where}: moe_layer_freq={_shown(value)}: expected an integer in [1, {MAX_LAYERS}] or a list of 0 / 1 per layer"
    )


def _check_values(args: Mapping[str, Any], where: str) -> None:
    """Each known argument given (not None) on its own: type, range, choice."""
    for name, value in args.items():
        if value is None:
            continue
        if name in INT_RANGES:
            _check_int(name, value, where)
        elif name in FLOAT_RANGES:
            _check_number(name, value, where)
        elif name in BOOLEANS and not isinstance(value, bool):
            raise ConversionError(f"{where}: {name}={_shown(value)}: expected true or false")
        elif name in CHOICES or name == "moe_router_load_balancing_type":
            _check_choice(name, value, where)
        elif name == "moe_layer_freq":
            _check_layer_freq(value, args, where)


def _given(args: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` given (not None)."""
    return next((args[n] for n in names if args.get(n) is not None), None)


def _check_heads(args: Mapping[str, Any], where: str) -> None:
    """Plain attention's sizes divide: hidden by heads (no ``kv_channels``), heads by groups; the
    head size is even (RoPE rotates pairs)."""
    hidden, heads = args.get("hidden_size"), args.get("num_attention_heads")
    groups, channels = args.get("num_query_groups"), args.get("kv_channels")
    if hidden is not None and heads is not None and channels is None:
        if hidden % heads:
            raise ConversionError(
                f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} (give kv_channels)"
            )
        channels = hidden // heads
    if heads is not None and groups is not None and args.get("group_query_attention") is not False and heads % groups:
        raise ConversionError(f"{where}: num_attention_heads={heads} is not a multiple of num_query_groups={groups}")
    if channels is not None and channels % 2:
        raise ConversionError(f"{where}: kv_channels={channels}: RoPE needs an even head size")


def _check_routing(args: Mapping[str, Any], where: str) -> None:
    """The router's top-k and groups fit the experts."""
    experts = _given(args, "num_experts", "num_moe_experts")
    topk, groups = args.get("moe_router_topk"), args.get("moe_router_num_groups")
    if not experts:
        return
    if topk is not None and topk > experts:
        raise ConversionError(f"{where}: moe_router_topk={topk} exceeds num_experts={experts}")
    if groups:
        picked = args.get("moe_router_group_topk")
        if experts % groups:
            raise ConversionError(f"{where}: moe_router_num_groups={groups} does not divide num_experts={experts}")
        if picked is not None and picked > groups:
            raise ConversionError(f"{where}: moe_router_group_topk={picked} exceeds moe_router_num_groups={groups}")


def check_mcore_config(args: Mapping[str, Any], where: str) -> None:
    """Refuse, in one :class:`~mfsdp_ckpt.errors.ConversionError` line naming ``where`` and the
    argument, MCore arguments no model can be built with (see the module docstring)."""
    if not isinstance(args, Mapping):
        raise ConversionError(f"{where}: expected a mapping of MCore arguments, got {type(args).__name__}")
    _check_values(args, where)
    if args.get("multi_latent_attention"):
        rope = args.get("qk_pos_emb_head_dim")
        if rope is not None and rope % 2:
            raise ConversionError(f"{where}: qk_pos_emb_head_dim={rope}: RoPE needs an even size")
    else:
        _check_heads(args, where)
    _check_routing(args, where)


def shape_fields(args: Mapping[str, Any]) -> dict[str, Any]:
    """The model shape fields (our config's names) that checked MCore arguments give, with
    Megatron-LM's defaults (``ffn_hidden_size`` 4·hidden, query groups = heads, tied output)."""
    hidden, heads = args.get("hidden_size") or 0, args.get("num_attention_heads") or 1
    experts = _given(args, "num_experts", "num_moe_experts") or 0
    groups = heads if args.get("group_query_attention") is False else _given(args, "num_query_groups") or heads
    return {
        "vocab_size": _given(args, "padded_vocab_size", "vocab_size") or 0,
        "hidden_size": hidden,
        "num_layers": args.get("num_layers") or 0,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": _given(args, "kv_channels") or hidden // heads,
        "ffn_hidden_size": _given(args, "ffn_hidden_size") or 4 * hidden,
        "tie_embeddings": not args.get("untie_embeddings_and_output_weights"),
        "num_experts": experts,
        "moe_ffn_hidden_size": _given(args, "moe_ffn_hidden_size", "ffn_hidden_size") or 0,
        "moe_shared_expert_ffn_hidden_size": _given(args, "moe_shared_expert_intermediate_size") or 0,
        **{n: args.get(n) or 0 for n in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim")},
        "v_head_dim": args.get("v_head_dim") or 0,
        "multi_latent_attention": bool(args.get("multi_latent_attention")),
    }


def _attention_parameters(s: Mapping[str, Any]) -> int:
    """One attention layer's projection weights (norms left out: a lower bound)."""
    hidden, heads = s["hidden_size"], s["num_attention_heads"]
    if s.get("multi_latent_attention"):
        qk, rope, v, q_rank, kv_rank = (
            s[n] for n in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank")
        )
        query = hidden * q_rank + q_rank * heads * (qk + rope) if q_rank else hidden * heads * (qk + rope)
        return query + hidden * (kv_rank + rope) + kv_rank * heads * (qk + v) + heads * v * hidden
    channels, groups = s["kv_channels"], s["num_query_groups"]
    return (heads + 2 * groups) * channels * hidden + heads * channels * hidden


def estimate_parameters(s: Mapping[str, Any]) -> int:
    """A lower bound of the parameter count of the model of shape fields ``s`` (our config's
    names: a model config's ``to_dict()`` or :func:`shape_fields`): embeddings, attention
    projections of the attention layers, dense MLPs, experts, routers and shared experts, and
    each MTP layer's projection, attention and MLP (norms, biases and DeltaNet layers left out)."""
    hidden, layers, experts = s["hidden_size"], s["num_layers"], s.get("num_experts") or 0
    total = s["vocab_size"] * hidden * (1 if s.get("tie_embeddings") else 2)
    kinds = s.get("layer_kinds") or ()
    attention = _attention_parameters(s)
    total += (layers - sum(1 for k in kinds if k != "attention")) * attention
    dense = layers if not experts else min(s.get("first_k_dense_replace") or 0, layers)
    dense_mlp = 3 * hidden * s["ffn_hidden_size"]
    moe = experts * (3 * hidden * (s.get("moe_ffn_hidden_size") or 0) + hidden)
    moe += 3 * hidden * (s.get("moe_shared_expert_ffn_hidden_size") or 0)
    total += dense * dense_mlp + (layers - dense) * moe
    mtp_layer = 2 * hidden * hidden + attention + (moe if experts else dense_mlp)
    return total + (s.get("mtp_num_layers") or 0) * mtp_layer


def check_against_tensors(fields: Mapping[str, Any], present: int, where: str) -> None:
    """Refuse a model config (shape ``fields``) that needs more parameters than the ``present``
    elements of a checkpoint's model tensors: building it would describe weights that are not there."""
    needed = estimate_parameters(fields)
    if needed > present:
        raise ConversionError(
            f"{where}: the model config describes at least {needed:,} parameters, the checkpoint's model "
            f"tensors hold {present:,} elements"
        )


def check_fits_memory(fields: Mapping[str, Any], where: str, copies: int = 1, available: int | None = None) -> int:
    """The parameter count (a lower bound) of a fresh model of shape ``fields`` (a model config's
    ``to_dict()``, or :func:`shape_fields` of checked MCore arguments); refused when ``copies``
    fp32 copies of it (one per process of this machine, each of which builds the whole model
    before sharding) exceed the memory ``available`` (default: this machine's physical memory,
    :func:`~mfsdp_ckpt.hf.config_check.machine_memory`: the same figure on every rank, so that
    the launcher and each rank decide alike)."""
    count = estimate_parameters(fields)
    need = count * 4 * max(1, copies)
    have = machine_memory() if available is None else available
    if have is not None and need > have:
        raise ConversionError(
            f"{where}: the model has at least {count:,} parameters: {need / 2**30:.1f} GiB in fp32 "
            f"({max(1, copies)} cop{'y' if copies <= 1 else 'ies'}), more than this machine's memory "
            f"({have / 2**30:.1f} GiB)"
        )
    return count


def check_mcore_config_file(path: str | os.PathLike, copies: int = 1) -> dict[str, Any]:
    """The launcher's check of ``mfsdp-train --mcore-config path`` before any rank starts (torch-free):
    the file read and checked (:func:`read_mcore_args`) and the fresh model sized against
    the machine's memory for ``copies`` processes (:func:`check_fits_memory`); ConversionError naming
    the path. Returns the arguments."""
    args = read_mcore_args(path)
    check_fits_memory(shape_fields(args), os.fspath(path), copies)
    return args
