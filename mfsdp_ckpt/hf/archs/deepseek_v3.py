"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention, ``first_k_dense_replace``
dense layers then MoE layers with a shared expert and a sigmoid router with an expert bias
(``e_score_correction_bias``), group-limited top-k and a routed scaling factor, and
multi-token-prediction layers stored after the decoder's as DeepSeek releases them
(``model.layers.{num_hidden_layers + k}.*``, with copies of the embedding and the output head,
which transformers' ``MtpModel`` reads).

Our MLA rotates RoPE dimensions stored as interleaved pairs, DeepSeek's layout
(``rope_interleave: true``); a checkpoint with ``rope_interleave: false`` is refused. A group's
score is the sum of its top 2 experts' scores in transformers' router, ours sums the top
``topk / topk_group``: configs where these differ are refused."""

from __future__ import annotations

from mfsdp_ckpt.hf.archs._common import DENSE_MLP, H, L, feature_problems, moe_mlp
from mfsdp_ckpt.hf.config import MAX_COUNT, HFConfigReader, common_to_hf, model_config, read_rope
from mfsdp_ckpt.hf.mapping import Architecture, Direct, GatedMLP, Replicated, moe_layer, untied
from mfsdp_ckpt.model.shape import ModelShape

_ATTN = L + "self_attention."
_HF_ATTN = H + "self_attn."


def _q_lora(c: ModelShape) -> bool:
    return c.q_lora_rank > 0


def _no_q_lora(c: ModelShape) -> bool:
    return c.q_lora_rank == 0


RULES = (
    Replicated(
        "embedding.word_embeddings.weight", ("model.embed_tokens.weight", "model.layers.{n}.embed_tokens.weight")
    ),
    Direct(L + "input_layernorm.weight", H + "input_layernorm.weight"),
    Direct(_ATTN + "linear_q_proj.weight", _HF_ATTN + "q_proj.weight", when=_no_q_lora),
    Direct(_ATTN + "linear_q_down_proj.weight", _HF_ATTN + "q_a_proj.weight", when=_q_lora),
    Direct(_ATTN + "linear_q_up_proj.layer_norm_weight", _HF_ATTN + "q_a_layernorm.weight", when=_q_lora),
    Direct(_ATTN + "linear_q_up_proj.weight", _HF_ATTN + "q_b_proj.weight", when=_q_lora),
    Direct(_ATTN + "linear_kv_down_proj.weight", _HF_ATTN + "kv_a_proj_with_mqa.weight"),
    Direct(_ATTN + "linear_kv_up_proj.layer_norm_weight", _HF_ATTN + "kv_a_layernorm.weight"),
    Direct(_ATTN + "linear_kv_up_proj.weight", _HF_ATTN + "kv_b_proj.weight"),
    Direct(_ATTN + "linear_proj.weight", _HF_ATTN + "o_proj.weight"),
    *DENSE_MLP,
    *moe_mlp("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    Direct(L + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias", layers=moe_layer),
    GatedMLP(
        L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"),
        layers=moe_layer,
    ),
    Direct(L + "mlp.shared_experts.linear_fc2.weight", H + "mlp.shared_experts.down_proj.weight", layers=moe_layer),
    Direct("mtp.layers.{k}.enorm.weight", "model.layers.{n}.enorm.weight"),
    Direct("mtp.layers.{k}.hnorm.weight", "model.layers.{n}.hnorm.weight"),
    Direct("mtp.layers.{k}.eh_proj.weight", "model.layers.{n}.eh_proj.weight"),
    Direct("mtp.layers.{k}.final_layernorm.weight", "model.layers.{n}.shared_head.norm.weight"),
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Replicated("output_layer.weight", ("lm_head.weight", "model.layers.{n}.shared_head.head.weight"), when=untied),
)


def unsupported(c: ModelShape) -> list[str]:
    allowed = frozenset(
        {
            "multi_latent_attention",
            "rope_type",
            "first_k_dense_replace",
            "moe_router_enable_expert_bias",
            "moe_router_num_groups",
            "moe_router_topk_scaling_factor",
            "mtp_num_layers",
        }
    )
    out = feature_problems(c, moe=True, qk_norm=False, qkv_bias=False, allowed=allowed)
    if not c.multi_latent_attention:
        out.append("standard attention (multi_latent_attention=False); DeepSeek-V3 has multi-latent attention")
    if c.num_experts:
        if c.moe_score_func != "sigmoid":
            out.append(f"moe_score_func={c.moe_score_func!r} (DeepSeek-V3 routes by sigmoid scores)")
        if not c.moe_router_enable_expert_bias:
            out.append("no router expert bias (DeepSeek-V3's router always has e_score_correction_bias)")
        if c.moe_shared_expert_ffn_hidden_size == 0 or c.moe_shared_expert_ffn_hidden_size % c.moe_ffn_hidden_size:
            out.append(
                f"moe_shared_expert_ffn_hidden_size={c.moe_shared_expert_ffn_hidden_size} (DeepSeek-V3 has "
                f"n_shared_experts >= 1 experts of moe_ffn_hidden_size={c.moe_ffn_hidden_size})"
            )
        if c.moe_router_num_groups > 1 and c.moe_router_topk // c.moe_router_group_topk != 2:
            out.append(
                f"moe_router_topk / moe_router_group_topk = {c.moe_router_topk // c.moe_router_group_topk} "
                "(transformers' DeepSeek-V3 router scores a group by its top 2 experts)"
            )
    return out


def to_hf_config(c: ModelShape) -> dict:
    groups = c.moe_router_num_groups or 1
    return {
        **common_to_hf(c, "deepseek_v3", "DeepseekV3ForCausalLM"),
        **_rope_to_hf(c),
        "num_key_value_heads": c.num_attention_heads,
        "head_dim": c.qk_pos_emb_head_dim,
        "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "n_routed_experts": c.num_experts,
        "n_shared_experts": c.moe_shared_expert_ffn_hidden_size // max(c.moe_ffn_hidden_size, 1),
        "num_experts_per_tok": c.moe_router_topk,
        "n_group": groups,
        "topk_group": c.moe_router_group_topk or groups,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor,
        "norm_topk_prob": True,
        "first_k_dense_replace": c.first_k_dense_replace,
        "q_lora_rank": c.q_lora_rank or None,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_head_dim,
        "qk_rope_head_dim": c.qk_pos_emb_head_dim,
        "v_head_dim": c.v_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": c.mtp_num_layers,
        "attention_bias": False,
        "pretraining_tp": 1,
    }


def _rope_to_hf(c: ModelShape) -> dict:
    if c.rope_type != "yarn":
        return {}
    yarn = {
        "rope_type": "yarn",
        "rope_theta": c.rotary_base,
        "factor": c.rotary_scaling_factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
        "beta_fast": c.beta_fast,
        "beta_slow": c.beta_slow,
        "mscale": c.mscale,
        "mscale_all_dim": c.mscale_all_dim,
    }
    return {"rope_parameters": yarn, "rope_scaling": {k: v for k, v in yarn.items() if k != "rope_theta"}}


def from_hf_config(d: dict, source: str) -> ModelShape:
    r = HFConfigReader(d, source, "deepseek_v3")
    heads = r.integer("num_attention_heads", hi=MAX_COUNT)
    experts = r.integer(("n_routed_experts", "num_local_experts"), 256, hi=MAX_COUNT)
    moe_ffn = r.integer("moe_intermediate_size")
    groups = r.integer("n_group", 1, hi=MAX_COUNT)
    topk_group = r.integer("topk_group", 1, hi=MAX_COUNT)
    r.refuse(r.flag("rope_interleave", True), "rope_interleave=false (our MLA takes RoPE dims as interleaved pairs)")
    r.refuse(not r.flag("attention_bias", False), "attention_bias=true (biases on the attention projections)")
    r.refuse(r.flag("norm_topk_prob", True), "norm_topk_prob=false (our sigmoid router renormalises the top-k)")
    r.refuse(
        r.text("topk_method", "noaux_tc") == "noaux_tc", f"topk_method={r.text('topk_method', '')!r} (only noaux_tc)"
    )
    r.refuse(
        r.text("scoring_func", "sigmoid") == "sigmoid", f"scoring_func={r.text('scoring_func', '')!r} (only sigmoid)"
    )
    act = r.text("hidden_act", "silu")
    r.refuse(act in ("silu", "swish"), f"hidden_act={act!r} (only SwiGLU with silu)")
    return model_config(
        r,
        {
            **read_rope(r, allow_yarn=True),
            "vocab_size": r.integer("vocab_size"),
            "hidden_size": r.integer("hidden_size"),
            "num_layers": r.integer("num_hidden_layers", hi=MAX_COUNT),
            "num_attention_heads": heads,
            "num_query_groups": heads,
            "kv_channels": r.integer("qk_rope_head_dim", 64),
            "ffn_hidden_size": r.integer("intermediate_size"),
            "seq_length": r.integer("max_position_embeddings", 4096, hi=2**31 - 1),
            "norm_epsilon": r.number("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, below=True),
            "tie_embeddings": r.flag("tie_word_embeddings", False),
            "multi_latent_attention": True,
            "q_lora_rank": r.integer("q_lora_rank", 0, lo=0),
            "kv_lora_rank": r.integer("kv_lora_rank"),
            "qk_head_dim": r.integer("qk_nope_head_dim"),
            "qk_pos_emb_head_dim": r.integer("qk_rope_head_dim", 64),
            "v_head_dim": r.integer("v_head_dim"),
            "num_experts": experts,
            "moe_ffn_hidden_size": moe_ffn,
            "moe_shared_expert_ffn_hidden_size": moe_ffn * r.integer("n_shared_experts", 1, lo=1, hi=MAX_COUNT),
            "moe_router_topk": r.integer("num_experts_per_tok", 8, hi=MAX_COUNT),
            "moe_score_func": "sigmoid",
            "moe_aux_loss_coeff": 0.0,
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": topk_group if groups > 1 else 0,
            "moe_router_topk_scaling_factor": r.number("routed_scaling_factor", 1.0, lo=0.0, above=True),
            "first_k_dense_replace": r.integer("first_k_dense_replace", 0, lo=0, hi=MAX_COUNT),
            "mtp_num_layers": r.integer(("num_nextn_predict_layers", "num_mtp_layers"), 0, lo=0, hi=MAX_COUNT),
        },
    )


ARCH = Architecture(
    "deepseek_v3",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    RULES,
    unsupported,
    to_hf_config,
    from_hf_config,
    mtp_layer="model.layers.{n}.",
)
