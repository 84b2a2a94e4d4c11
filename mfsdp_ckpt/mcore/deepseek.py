"""The DeepSeek-V3 family's part of the model config of an MCore checkpoint (:mod:`.config` does
the rest): multi-latent attention from the stored shapes, which layers are dense, the expert
bias and the multi-token-prediction layers from which tensors are stored, and from MCore's
arguments what no shape tells (RoPE / YaRN, the router's groups and scaling factor, the MTP
loss weight); both ways, with what cannot be mapped refused in one line.

**MLA shapes.** With ``H`` heads, ``n`` / ``r`` / ``v`` the per-head no-RoPE query-key, RoPE and
value dimensions and ``c`` the key-value rank: ``linear_kv_down_proj`` has ``c + r`` rows,
``linear_kv_up_proj`` is ``(H·(n + v), c)``, ``linear_q_up_proj`` (or ``linear_q_proj`` without
query compression) has ``H·(n + r)`` rows and ``linear_proj`` ``H·v`` columns. So
``H = (q rows − kv-up rows + proj columns) / r`` and everything else follows: the shapes alone
give every MLA dimension (checked against the arguments, when given).

**What our model computes differently, refused.** MCore's MLA without ``qk_layernorm`` has no
latent norms (ours always has them, as DeepSeek); MoE layers other than a block of dense layers
then MoE layers (``moe_layer_freq`` such as ``[1, 0, 1]``); softmax routing with groups but
without ``moe_router_pre_softmax`` (MCore then picks the groups by summing *logits*); an expert
bias with softmax routing; under YaRN, ``mscale`` / ``mscale_all_dim`` where MCore's factor on
cos / sin (``mscale(f, mscale) / mscale(f, mscale_all_dim)``, always) differs from ours and
DeepSeek's (that ratio when both are set, else ``mscale(f)``); plain RoPE with a softmax scale
that MCore still stretches (``rotary_scaling_factor`` > 1 with ``mscale_all_dim``).
"""

from __future__ import annotations

import math
from typing import Any

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.mcore.layout import STACK

__all__ = [
    "KV_DOWN",
    "mla_fields",
    "first_dense_layers",
    "expert_bias_field",
    "mtp_fields",
    "argument_fields",
    "mcore_arguments",
]

KV_DOWN = STACK + "self_attention.linear_kv_down_proj.weight"
KV_UP = STACK + "self_attention.linear_kv_up_proj.weight"
Q_DOWN = STACK + "self_attention.linear_q_down_proj.weight"
Q_UP = STACK + "self_attention.linear_q_up_proj.weight"
Q_PROJ = STACK + "self_attention.linear_q_proj.weight"
PROJ = STACK + "self_attention.linear_proj.weight"
#: the latent norms, as Transformer Engine's spec and MCore's local spec store them
KV_NORMS = (STACK + "self_attention.linear_kv_up_proj.layer_norm_weight", STACK + "self_attention.kv_layernorm.weight")
Q_NORMS = (STACK + "self_attention.linear_q_up_proj.layer_norm_weight", STACK + "self_attention.q_layernorm.weight")
EXPERT_BIAS = STACK + "mlp.router.expert_bias"
#: MCore's ``MLATransformerConfig`` defaults of what no shape tells
ROPE_DEFAULTS: dict[str, Any] = {
    "rope_type": "yarn",
    "rotary_scaling_factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}
_ROUTING = ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")


def _mla_dims(ev: Any) -> dict[str, int]:
    """Heads and every MLA dimension from the projections' shapes (module docstring)."""
    kv_down, kv_up, proj = ev.need(KV_DOWN), ev.need(KV_UP), ev.need(PROJ)
    q_up = ev.shapes(Q_UP)
    if q_up is not None:
        q_key, q_rank, q_rows = Q_UP, ev.need(Q_DOWN)[1], q_up[1]
    else:
        q_key, q_rank, q_rows = Q_PROJ, 0, ev.need(Q_PROJ)[1]
    kv_rank, v_total = kv_up[2], proj[2]
    rope = kv_down[1] - kv_rank
    heads_rope = q_rows - kv_up[1] + v_total
    heads = heads_rope // rope if rope > 0 and heads_rope > 0 and heads_rope % rope == 0 else 0
    if not heads or v_total % heads or (kv_up[1] - v_total) % heads or kv_up[1] <= v_total:
        raise ConversionError(
            f"{ev.source}: the shapes of '{q_key}' {list(ev.shapes(q_key))}, '{KV_DOWN}' {list(kv_down)}, "
            f"'{KV_UP}' {list(kv_up)} and '{PROJ}' {list(proj)} are not those of multi-latent attention heads"
        )
    return {
        "num_attention_heads": ev.agree("num_attention_heads", heads, q_key),
        "q_lora_rank": ev.agree("q_lora_rank", q_rank, Q_DOWN) if q_rank else 0,
        "kv_lora_rank": ev.agree("kv_lora_rank", kv_rank, KV_UP),
        "qk_head_dim": ev.agree("qk_head_dim", (kv_up[1] - v_total) // heads, KV_UP),
        "qk_pos_emb_head_dim": ev.agree("qk_pos_emb_head_dim", rope, KV_DOWN),
        "v_head_dim": ev.agree("v_head_dim", v_total // heads, PROJ),
    }


def _check_mla_presence(ev: Any, hidden: int, q_lora: bool) -> None:
    """The projections fit ``hidden``, and the latent norms are there (MCore builds MLA without
    them unless ``qk_layernorm``; our model, as DeepSeek, always norms the latents)."""
    for key, dim in ((KV_DOWN, 2), (PROJ, 1), (Q_DOWN if q_lora else Q_PROJ, 2)):
        if ev.need(key)[dim] != hidden:
            raise ConversionError(f"{ev.source}: '{key}' {list(ev.need(key))} does not fit hidden size {hidden}")
    for norms, needed in ((KV_NORMS, True), (Q_NORMS, q_lora)):
        if needed and all(ev.shapes(k) is None for k in norms):
            raise ConversionError(
                f"{ev.source}: multi-latent attention without the latent norm ('{norms[0]}' or '{norms[1]}'): "
                "MCore's MLA without qk_layernorm, which our model (as DeepSeek's) cannot compute"
            )
    if ev.args.get("qk_layernorm") is False:
        raise ConversionError(
            f"{ev.where}: qk_layernorm=False with multi_latent_attention: MCore's MLA then has no latent norms, "
            "which our model (as DeepSeek's) always has"
        )


def mla_fields(ev: Any, hidden: int) -> dict[str, Any]:
    """Layer count, heads and the MLA dimensions (``num_query_groups`` / ``kv_channels``, unused
    by MLA, from the arguments or MCore's defaults)."""
    if ev.args.get("multi_latent_attention") is False:
        raise ConversionError(
            f"{ev.where}: multi_latent_attention=False disagrees with the checkpoint ('{KV_DOWN}' is present)"
        )
    layers = ev.agree("num_layers", ev.need(PROJ)[0], PROJ)
    dims = _mla_dims(ev)
    _check_mla_presence(ev, hidden, dims["q_lora_rank"] > 0)
    heads = dims["num_attention_heads"]
    groups, channels = ev.args.get("num_query_groups"), ev.args.get("kv_channels")
    if not (isinstance(groups, int) and groups > 0 and heads % groups == 0):
        groups = heads
    if not (isinstance(channels, int) and channels > 0):
        channels = hidden // heads or dims["v_head_dim"]
    return {
        "num_layers": layers,
        "multi_latent_attention": True,
        **dims,
        "num_query_groups": groups,
        "kv_channels": channels,
    }


def _layer_pattern(freq: Any, layers: int, where: str) -> list[int]:
    """MCore's ``moe_layer_freq`` as a list of 0 (dense) / 1 (MoE) per layer."""
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise ConversionError(f"{where}: moe_layer_freq={freq!r}: expected an integer or a list of 0 / 1 per layer")
    if isinstance(freq, int):
        return [1 if freq > 0 and i % freq == 0 else 0 for i in range(layers)]
    return [int(x) for x in freq]


def first_dense_layers(ev: Any, layers: int, router: str) -> int:
    """``first_k_dense_replace``: how many dense layers come before the MoE layers (the layers
    holding ``router``), refusing any other arrangement and a ``moe_layer_freq`` that disagrees."""
    moe = tuple(ev.layers(router) or ())
    k = layers - len(moe)
    if moe != tuple(range(k, layers)):
        dense = [i for i in range(layers) if i not in moe]
        raise ConversionError(
            f"{ev.source}: MoE layers {list(moe)} and dense layers {dense} ('{router}'): our model has its dense "
            "layers first (first_k_dense_replace), then only MoE layers"
        )
    freq = ev.args.get("moe_layer_freq")
    if freq is not None and _layer_pattern(freq, layers, ev.where) != [0] * k + [1] * (layers - k):
        raise ConversionError(
            f"{ev.where}: moe_layer_freq={freq!r} disagrees with the checkpoint: '{router}' is in layers {list(moe)}"
        )
    return k


def expert_bias_field(ev: Any) -> dict[str, bool]:
    """``moe_router_enable_expert_bias``: whether the routers' expert bias is stored."""
    present = ev.shapes(EXPERT_BIAS) is not None
    given = ev.args.get("moe_router_enable_expert_bias")
    if given is not None and bool(given) != present:
        raise ConversionError(
            f"{ev.where}: moe_router_enable_expert_bias={given!r} disagrees with the checkpoint ('{EXPERT_BIAS}' "
            f"is {'present' if present else 'absent'})"
        )
    return {"moe_router_enable_expert_bias": present}


def mtp_fields(ev: Any, mtp_layers: tuple[int, ...]) -> dict[str, int]:
    """``mtp_num_layers``: the MTP layers stored (``mtp.layers.<k>.*``, k = 0, 1, …)."""
    n = len(mtp_layers)
    if tuple(mtp_layers) != tuple(range(n)):
        raise ConversionError(
            f"{ev.source}: MTP layers {list(mtp_layers)} stored ('mtp.layers.<k>.*'): not 0 to {n - 1}"
        )
    given = ev.args.get("mtp_num_layers")
    if given is not None and given != n:
        raise ConversionError(
            f"{ev.where}: mtp_num_layers={given!r} disagrees with the checkpoint: it stores {n} ('mtp.layers.<k>.*')"
        )
    return {"mtp_num_layers": n}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _refuse_rope(v: dict[str, Any], where: str) -> None:
    """Refuse RoPE settings under which MCore's MLA and ours compute differently (module docstring)."""
    factor, mscale, all_dim = v["rotary_scaling_factor"], v["mscale"], v["mscale_all_dim"]
    if v["rope_type"] not in ("rope", "yarn"):
        raise ConversionError(f"{where}: rope_type={v['rope_type']!r}: only 'rope' or 'yarn'")
    if v["rope_type"] == "yarn" and factor > 1.0 and not (mscale and all_dim) and (mscale, all_dim) != (1.0, 0.0):
        raise ConversionError(
            f"{where}: mscale={mscale!r} with mscale_all_dim={all_dim!r}: MCore's YaRN scales cos/sin by "
            f"{_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim):.6g}, ours (as DeepSeek's) by "
            f"{_yarn_mscale(factor, 1.0):.6g}"
        )
    if v["rope_type"] == "rope" and factor > 1.0 and all_dim:
        raise ConversionError(
            f"{where}: rope_type='rope' with rotary_scaling_factor={factor!r} and mscale_all_dim={all_dim!r}: MCore "
            "still scales the attention softmax by YaRN's mscale, our model does not"
        )


def _rope_fields(args: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    assumed = []
    for name, default in ROPE_DEFAULTS.items():
        value = args.get(name)
        if value is None:
            value = default
            assumed.append(name)
        out[name] = value if name == "rope_type" else int(value) if isinstance(default, int) else float(value)
    if out["rope_type"] != "yarn":  # only these two matter then (the softmax scale)
        assumed = [a for a in assumed if a in ("rope_type", "rotary_scaling_factor", "mscale_all_dim")]
    _refuse_rope(out, where)
    return out, assumed


def _routing_fields(args: dict[str, Any], fields: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    groups, picked = int(args.get("moe_router_num_groups") or 0), int(args.get("moe_router_group_topk") or 0)
    scaling = args.get("moe_router_topk_scaling_factor")
    score = args.get("moe_router_score_function") or "softmax"
    if fields.get("moe_router_enable_expert_bias") and score != "sigmoid":
        raise ConversionError(
            f"{where}: an expert bias with moe_router_score_function={score!r}: MCore applies it to sigmoid routing only"
        )
    if groups and score == "softmax" and not args.get("moe_router_pre_softmax"):
        raise ConversionError(
            f"{where}: moe_router_num_groups={groups} with softmax routing without moe_router_pre_softmax: MCore "
            "then picks the groups by their top logits' sum, our model by the top probabilities' sum"
        )
    rate = args.get("moe_router_bias_update_rate")
    out = {
        "moe_router_num_groups": groups,
        "moe_router_group_topk": picked,
        "moe_router_topk_scaling_factor": float(scaling) if scaling is not None else 1.0,
        "moe_router_bias_update_rate": float(rate) if rate is not None else 1e-3,
    }
    assumed = [n for n in _ROUTING if n not in args] if fields.get("moe_router_enable_expert_bias") else []
    return out, assumed


def argument_fields(args: dict[str, Any], fields: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """``(fields, assumed)``: the DeepSeek family's fields no shape tells, from the arguments
    ``args`` (read from ``where``) of a model whose shape fields are ``fields``; ``assumed``: those
    taken from MCore's defaults (named only where they decide what the model computes: RoPE of an
    MLA model, the routing of one with an expert bias)."""
    out: dict[str, Any] = {}
    assumed: list[str] = []
    if fields.get("multi_latent_attention"):
        rope, assumed = _rope_fields(args, where)
        out.update(rope)
    if fields.get("num_experts"):
        routing, more = _routing_fields(args, fields, where)
        out.update(routing)
        assumed += more
    if fields.get("mtp_num_layers"):
        scale = args.get("mtp_loss_scaling_factor")
        out["mtp_loss_scaling_factor"] = float(scale) if scale is not None else 0.1
    return out, assumed


def _refuse_unexportable(cfg: Any, where: str) -> None:
    """Refuse, in one line, a model whose MCore arguments are not written (not mapped / not checked)."""
    what = []
    if "linear_attention" in cfg.layer_kinds:
        what.append("gated DeltaNet layers (layer_kinds)")
    for name, default in (
        ("attention_output_gate", False),
        ("rotary_percent", 1.0),
        ("layernorm_zero_centered_gamma", False),
        ("moe_shared_expert_gate", False),
    ):
        if getattr(cfg, name) != default:
            what.append(f"{name}={getattr(cfg, name)!r}")
    if cfg.rope_type != "rope" and not cfg.multi_latent_attention:
        what.append(f"rope_type={cfg.rope_type!r} without multi-latent attention")
    if what:
        raise ConversionError(f"{where}: export-mcore does not map {', '.join(what)} to Megatron-Core")


def mcore_arguments(cfg: Any, where: str) -> dict[str, Any]:
    """The DeepSeek family's MCore (Megatron-LM) arguments of model shape ``cfg`` (only those of
    the features it uses), refusing a model export-mcore does not map."""
    _refuse_unexportable(cfg, where)
    out: dict[str, Any] = {}
    if cfg.multi_latent_attention:
        out.update(
            multi_latent_attention=True,
            qk_layernorm=True,  # MCore's MLA norms its latents only with qk_layernorm; ours always does
            q_lora_rank=cfg.q_lora_rank or None,
            **{n: getattr(cfg, n) for n in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")},
            **{n: getattr(cfg, n) for n in ROPE_DEFAULTS},
        )
        _refuse_rope(out, where)
    if cfg.num_experts:
        k = cfg.first_k_dense_replace
        out["moe_layer_freq"] = [0] * k + [1] * (cfg.num_layers - k) if k else 1
        if cfg.moe_router_enable_expert_bias:
            out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=cfg.moe_router_bias_update_rate)
        if cfg.moe_router_num_groups:
            out.update(moe_router_num_groups=cfg.moe_router_num_groups, moe_router_group_topk=cfg.moe_router_group_topk)
        if cfg.moe_router_topk_scaling_factor != 1.0:
            out["moe_router_topk_scaling_factor"] = cfg.moe_router_topk_scaling_factor
        given = {
            **out,
            "moe_router_score_function": cfg.moe_score_func,
            "moe_router_pre_softmax": cfg.moe_router_pre_softmax,
        }
        _routing_fields(given, out, where)
    if cfg.mtp_num_layers:
        out.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    return out
