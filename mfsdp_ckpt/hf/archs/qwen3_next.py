"""Qwen3-Next (``Qwen3NextForCausalLM``): layers of gated DeltaNet linear attention and, every
``full_attention_interval``-th (``layer_types``), gated full attention (an output gate per head
from a second half of ``q_proj``, per-head zero-centered q/k norms, RoPE on ``partial_rotary_factor``
of each head); MoE layers (softmax top-k) with a shared expert scaled by a sigmoid gate;
zero-centered RMSNorm weights (``1 + weight``), except the DeltaNet's gated output norm.

Our layers use Megatron-Core's layout: gated attention's ``linear_qkv`` holds, per query group,
the group's q heads, their gate heads, its k head and its v head; the DeltaNet's ``in_proj``
holds q, k, v, z, b, a one after the other (transformers interleaves them per key head in
``in_proj_qkvz`` and ``in_proj_ba``). Both are row permutations, mapped exactly.

transformers' Qwen3-Next has no multi-token-prediction layers and ignores the ``mtp.*`` tensors
of released checkpoints; so does this bridge (it names them when it leaves them out)."""

from __future__ import annotations

import torch

from mfsdp_ckpt.hf.archs._common import DENSE_MLP, EMBEDDING, HEAD, H, L, feature_problems, moe_mlp
from mfsdp_ckpt.hf.config import MAX_COUNT, HFConfigReader, common_from_hf, common_to_hf, model_config
from mfsdp_ckpt.hf.mapping import (
    Architecture,
    Direct,
    GatedMLP,
    Rule,
    attention_layer,
    linear_attention_layer,
    moe_layer,
)
from mfsdp_ckpt.model.shape import ModelShape

_ATTN, _HF_ATTN, _HF_LIN = L + "self_attention.", H + "self_attn.", H + "linear_attn."


class GatedQKV(Rule):
    """Gated attention's ``linear_qkv`` (per query group: ``per`` q heads, ``per`` gate heads, a k
    head, a v head) ⇄ ``q_proj`` (per head: its q rows then its gate rows), ``k_proj``,
    ``v_proj``."""

    @staticmethod
    def _dims(c: ModelShape) -> tuple[int, int, int]:
        return c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.kv_channels

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        g, per, d = self._dims(c)
        rest = tuple(shape[1:])
        return [torch.Size((g * per * 2 * d, *rest)), torch.Size((g * d, *rest)), torch.Size((g * d, *rest))]

    def views(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        g, per, d = self._dims(c)
        rest = tuple(tensor.shape[1:])
        grouped = tensor.view(g, 2 * per + 2, d, *rest)
        # [g, (q|gate), per, d, ...] -> [g, per, (q|gate), d, ...]: HF's per-head order, as a view
        q_and_gate = grouped[:, : 2 * per].view(g, 2, per, d, *rest).transpose(1, 2)
        return [q_and_gate, grouped[:, 2 * per], grouped[:, 2 * per + 1]]

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        g, per, d = self._dims(c)
        q_proj, k, v = tensors
        rest = tuple(q_proj.shape[1:])
        q_and_gate = q_proj.reshape(g, per, 2, d, *rest).transpose(1, 2).reshape(g, 2 * per, d, *rest)
        fused = torch.cat([q_and_gate, k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
        return fused.reshape(g * (2 * per + 2) * d, *rest).contiguous()


class DeltaNetInProj(Rule):
    """The DeltaNet's ``in_proj`` (rows q, k, v, z, b, a, each over all heads) ⇄ transformers'
    ``in_proj_qkvz`` (per key head: its q, k, and the v and z of its value heads) and
    ``in_proj_ba`` (per key head: b, then a, of its value heads)."""

    @staticmethod
    def _dims(c: ModelShape) -> tuple[int, int, int, int]:
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        return nk, nv // nk, c.linear_key_head_dim, c.linear_value_head_dim

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        nk, per, dk, dv = self._dims(c)
        rest = tuple(shape[1:])
        return [torch.Size((nk * (2 * dk + 2 * per * dv), *rest)), torch.Size((nk * 2 * per, *rest))]

    def split(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        nk, per, dk, dv = self._dims(c)
        rest = tuple(tensor.shape[1:])
        q, k, v, z, b, a = tensor.split([nk * dk, nk * dk, nk * per * dv, nk * per * dv, nk * per, nk * per])
        qkvz = torch.cat(
            [
                q.reshape(nk, dk, *rest),
                k.reshape(nk, dk, *rest),
                v.reshape(nk, per * dv, *rest),
                z.reshape(nk, per * dv, *rest),
            ],
            dim=1,
        )
        ba = torch.cat([b.reshape(nk, per, *rest), a.reshape(nk, per, *rest)], dim=1)
        return [qkvz.reshape(-1, *rest).contiguous(), ba.reshape(-1, *rest).contiguous()]

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        nk, per, dk, dv = self._dims(c)
        qkvz, ba = tensors
        rest = tuple(qkvz.shape[1:])
        q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * per * dv, *rest).split([dk, dk, per * dv, per * dv], dim=1)
        b, a = ba.reshape(nk, 2 * per, *rest).split([per, per], dim=1)
        parts = [q, k, v, z, b, a]
        return torch.cat([p.reshape(-1, *rest) for p in parts]).contiguous()


RULES = (
    EMBEDDING,
    Direct(_ATTN + "linear_qkv.layer_norm_weight", H + "input_layernorm.weight", layers=attention_layer),
    GatedQKV(
        _ATTN + "linear_qkv.weight",
        (_HF_ATTN + "q_proj.weight", _HF_ATTN + "k_proj.weight", _HF_ATTN + "v_proj.weight"),
        layers=attention_layer,
    ),
    Direct(_ATTN + "q_layernorm.weight", _HF_ATTN + "q_norm.weight", layers=attention_layer),
    Direct(_ATTN + "k_layernorm.weight", _HF_ATTN + "k_norm.weight", layers=attention_layer),
    Direct(_ATTN + "linear_proj.weight", _HF_ATTN + "o_proj.weight", layers=attention_layer),
    Direct(_ATTN + "in_proj.layer_norm_weight", H + "input_layernorm.weight", layers=linear_attention_layer),
    DeltaNetInProj(
        _ATTN + "in_proj.weight",
        (_HF_LIN + "in_proj_qkvz.weight", _HF_LIN + "in_proj_ba.weight"),
        layers=linear_attention_layer,
    ),
    Direct(_ATTN + "conv1d.weight", _HF_LIN + "conv1d.weight", layers=linear_attention_layer),
    Direct(_ATTN + "dt_bias", _HF_LIN + "dt_bias", layers=linear_attention_layer),
    Direct(_ATTN + "A_log", _HF_LIN + "A_log", layers=linear_attention_layer),
    Direct(_ATTN + "out_norm.weight", _HF_LIN + "norm.weight", layers=linear_attention_layer),
    Direct(_ATTN + "out_proj.weight", _HF_LIN + "out_proj.weight", layers=linear_attention_layer),
    *DENSE_MLP,
    *moe_mlp("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    GatedMLP(
        L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"),
        layers=moe_layer,
    ),
    Direct(L + "mlp.shared_experts.linear_fc2.weight", H + "mlp.shared_expert.down_proj.weight", layers=moe_layer),
    Direct(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight", layers=moe_layer),
    *HEAD,
)

#: the transformers-side tensors this bridge leaves out on import (released checkpoints' MTP)
IGNORED = ((r"mtp\..*", "transformers' Qwen3-Next has no multi-token-prediction layers either"),)


def unsupported(c: ModelShape) -> list[str]:
    allowed = frozenset(
        {
            "first_k_dense_replace",
            "moe_shared_expert_gate",
            "layer_kinds",
            "attention_output_gate",
            "rotary_percent",
            "layernorm_zero_centered_gamma",
        }
    )
    out = feature_problems(c, moe=c.num_experts > 0, qk_norm=True, qkv_bias=False, allowed=allowed)
    if not c.attention_output_gate:
        out.append("attention without an output gate (Qwen3-Next's attention is gated)")
    if not c.layernorm_zero_centered_gamma:
        out.append("plain norm weights (Qwen3-Next stores 1 + weight: layernorm_zero_centered_gamma)")
    if c.num_experts:
        if c.moe_score_func != "softmax":
            out.append(f"moe_score_func={c.moe_score_func!r} (only softmax routing)")
        if c.moe_shared_expert_ffn_hidden_size == 0 or not c.moe_shared_expert_gate:
            out.append("no gated shared expert (every Qwen3-Next MoE layer has one)")
    return out


def to_hf_config(c: ModelShape) -> dict:
    base = common_to_hf(c, "qwen3_next", "Qwen3NextForCausalLM")
    base["rope_parameters"] = {**base["rope_parameters"], "partial_rotary_factor": c.rotary_percent}
    return {
        **base,
        "partial_rotary_factor": c.rotary_percent,
        "intermediate_size": c.ffn_hidden_size,
        "layer_types": [_HF_KINDS[c.layer_kind(i)] for i in range(c.num_layers)],
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.moe_router_topk,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": c.moe_shared_expert_ffn_hidden_size,
        "norm_topk_prob": not c.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(c.first_k_dense_replace)) if c.num_experts else [],
        "router_aux_loss_coef": c.moe_aux_loss_coeff,
        "attention_bias": False,
    }


_KINDS = {"linear_attention": "linear_attention", "full_attention": "attention"}
_HF_KINDS = {ours: theirs for theirs, ours in _KINDS.items()}


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "qwen3_next")
    kwargs = common_from_hf(r, tie_default=False)
    r.refuse(not r.flag("attention_bias", False), "attention_bias=true (biases on q/k/v/o projections)")
    layers = kwargs["num_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        interval = r.integer("full_attention_interval", 4, hi=MAX_COUNT)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or not all(k in _KINDS for k in kinds):
        raise r.bad("layer_types", f"a list of {' / '.join(_KINDS)}", kinds)
    rope = r.section("rope_parameters")
    rotary = rope.number("partial_rotary_factor", r.number("partial_rotary_factor", 0.25, lo=0.0), lo=0.0, above=True)
    experts = r.integer("num_experts", 0, lo=0, hi=MAX_COUNT)
    step = r.integer("decoder_sparse_step", 1, lo=0, hi=MAX_COUNT)
    r.refuse(step == 1, f"decoder_sparse_step={step} (our model has MoE in every layer after the dense ones)")
    dense = r.integers("mlp_only_layers", [])
    r.refuse(dense == list(range(len(dense))), f"mlp_only_layers={dense} (only the first layers can be dense)")
    return model_config(
        r,
        {
            **kwargs,
            "ffn_hidden_size": r.integer("intermediate_size"),
            "layer_kinds": tuple(_KINDS[k] for k in kinds),
            "linear_num_key_heads": r.integer("linear_num_key_heads", hi=MAX_COUNT),
            "linear_num_value_heads": r.integer("linear_num_value_heads", hi=MAX_COUNT),
            "linear_key_head_dim": r.integer("linear_key_head_dim"),
            "linear_value_head_dim": r.integer("linear_value_head_dim"),
            "linear_conv_kernel_dim": r.integer("linear_conv_kernel_dim", 4, hi=MAX_COUNT),
            "qk_layernorm": True,
            "attention_output_gate": True,
            "rotary_percent": rotary,
            "layernorm_zero_centered_gamma": True,
            "num_experts": experts,
            "moe_router_topk": r.integer("num_experts_per_tok", 10, hi=MAX_COUNT),
            "moe_ffn_hidden_size": r.integer("moe_intermediate_size", 0, lo=0),
            "moe_shared_expert_ffn_hidden_size": r.integer("shared_expert_intermediate_size", 0, lo=0),
            "moe_shared_expert_gate": experts > 0,
            "moe_score_func": "softmax",
            "moe_router_pre_softmax": not r.flag("norm_topk_prob", True),
            "moe_aux_loss_coeff": r.number("router_aux_loss_coef", 0.001, lo=0.0),
            "first_k_dense_replace": len(dense) if experts else 0,
        },
    )


ARCH = Architecture(
    "qwen3_next",
    "qwen3_next",
    "Qwen3NextForCausalLM",
    RULES,
    unsupported,
    to_hf_config,
    from_hf_config,
    ignored=IGNORED,
)
