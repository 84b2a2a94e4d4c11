"""What the architecture modules share: key prefixes, the rule groups every Llama-family model
spells the same way (embedding, attention, dense MLP, final norm and head), and config checks.
An architecture module lists its rules by composing these groups with its own."""

from __future__ import annotations

from mfsdp_ckpt.hf.mapping import HF_LAYER, LAYER, Direct, FusedQKV, GatedMLP, Rule, dense_layer, moe_layer, untied
from mfsdp_ckpt.model.shape import ModelShape

#: canonical layer prefix (``model.`` is added by :func:`mfsdp_ckpt.hf.mapping.expand`)
L = LAYER
#: HF layer prefix
H = HF_LAYER

EMBEDDING = Direct("embedding.word_embeddings.weight", "model.embed_tokens.weight")
#: final norm, and the output head unless it is tied to the embedding
HEAD = (
    Direct("decoder.final_layernorm.weight", "model.norm.weight"),
    Direct("output_layer.weight", "lm_head.weight", when=untied),
)
#: SwiGLU MLP of a dense layer, with its pre-norm fused into ``linear_fc1``
DENSE_MLP = (
    Direct(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", layers=dense_layer),
    GatedMLP(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), layers=dense_layer),
    Direct(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", layers=dense_layer),
)


def attention(*, qkv_bias: bool = False, qk_norm: bool = False) -> tuple[Rule, ...]:
    """Pre-norm, fused QKV (and its bias), per-head q/k norms, output projection (``self_attn.*``)."""

    def qkv(kind: str) -> tuple[str, str, str]:
        return tuple(H + f"self_attn.{p}_proj.{kind}" for p in "qkv")  # type: ignore[return-value]

    rules: list[Rule] = [
        Direct(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),
        FusedQKV(L + "self_attention.linear_qkv.weight", qkv("weight")),
    ]
    if qkv_bias:
        rules.append(FusedQKV(L + "self_attention.linear_qkv.bias", qkv("bias")))
    if qk_norm:
        rules += [
            Direct(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"),
            Direct(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight"),
        ]
    rules.append(Direct(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"))
    return tuple(rules)


def moe_mlp(router: str, expert: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """An MoE layer: pre-norm, router, and per-expert SwiGLU weights under HF's ``expert``
    prefix (``{e}`` = global expert index) with its names for the gate / up / down projections."""
    return (
        Direct(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", layers=moe_layer),
        Direct(L + "mlp.router.weight", H + router, layers=moe_layer),
        GatedMLP(L + "mlp.experts.linear_fc1.weight{e}", (H + expert + gate, H + expert + up), layers=moe_layer),
        Direct(L + "mlp.experts.linear_fc2.weight{e}", H + expert + down, layers=moe_layer),
    )


#: model-config fields of features only some architectures have: field -> (its plain value, what
#: it is called when set)
_EXTENSIONS = {
    "multi_latent_attention": (False, "multi-latent attention"),
    "rope_type": ("rope", "scaled RoPE"),
    "first_k_dense_replace": (0, "dense layers before the MoE layers"),
    "moe_router_enable_expert_bias": (False, "a router expert bias"),
    "moe_router_num_groups": (0, "group-limited routing"),
    "moe_router_topk_scaling_factor": (1.0, "scaled routing weights"),
    "moe_shared_expert_gate": (False, "a gated shared expert"),
    "mtp_num_layers": (0, "multi-token prediction layers"),
    "layer_kinds": ((), "linear-attention layers"),
    "attention_output_gate": (False, "gated attention"),
    "rotary_percent": (1.0, "partial RoPE"),
    "layernorm_zero_centered_gamma": (False, "zero-centered norms"),
}


def extension_problems(c: ModelShape, allowed: frozenset[str] = frozenset()) -> list[str]:
    """The features of ``c`` (from :data:`_EXTENSIONS`) that an architecture not listing them
    in ``allowed`` cannot express."""
    out = []
    for name, (plain, what) in _EXTENSIONS.items():
        value = getattr(c, name)
        if name not in allowed and value != plain and not (name == "layer_kinds" and set(value) <= {"attention"}):
            shown = list(value) if isinstance(value, tuple) else value
            out.append(f"{what} ({name}={shown!r})")
    return out


def feature_problems(
    c: ModelShape, *, moe: bool, qk_norm: bool, qkv_bias: bool, allowed: frozenset[str] = frozenset()
) -> list[str]:
    """What in ``c`` differs from an architecture that has MoE layers (or not), q/k norms (or
    not) and q/k/v biases (or not): those are fixed by the architecture, not configurable; and
    the features of the newer families the architecture has not (``allowed``: those it has)."""
    out = extension_problems(c, allowed)
    if moe and c.num_experts == 0:
        out.append("a dense model (num_experts=0); this architecture has MoE layers")
    if not moe and c.num_experts > 0:
        out.append(f"MoE layers (num_experts={c.num_experts}); this architecture is dense")
    if c.qk_layernorm != qk_norm:
        out.append(
            f"qk_layernorm={c.qk_layernorm}; this architecture {'always has' if qk_norm else 'has no'} q/k norms"
        )
    if c.add_qkv_bias != qkv_bias:
        out.append(
            f"add_qkv_bias={c.add_qkv_bias}; this architecture {'always has' if qkv_bias else 'has no'} q/k/v biases"
        )
    return out


def moe_problems(c: ModelShape, *, renormalises_only: bool) -> list[str]:
    """Router features our MoE layers have and these HF MoE blocks lack."""
    out = []
    if c.num_experts == 0:
        return out
    if c.moe_shared_expert_ffn_hidden_size > 0:
        out.append(f"a shared expert (moe_shared_expert_ffn_hidden_size={c.moe_shared_expert_ffn_hidden_size})")
    if c.moe_score_func != "softmax":
        out.append(f"moe_score_func={c.moe_score_func!r} (only softmax routing)")
    if renormalises_only and c.moe_router_pre_softmax:
        out.append("moe_router_pre_softmax=True (this router always renormalises the top-k weights)")
    return out
