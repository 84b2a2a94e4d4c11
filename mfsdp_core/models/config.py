"""The shape of a reference GPT model (:class:`GPTConfig`) and its named presets.

One flat, JSON-able dataclass describes every model the reference GPT builds: the Llama / Qwen /
Mixtral family, DeepSeek-V3 (multi-latent attention, sigmoid routing with an expert bias and
group-limited top-k, dense first layers, multi-token prediction) and Qwen3-Next (gated DeltaNet
and gated attention layers). Field names follow Megatron-Core's ``TransformerConfig`` where it has
the feature. Every field added after the first release has a default that builds the model as it
was before the field existed, so manifests written earlier keep loading.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["GPTConfig", "PRESETS", "get_preset", "ROPE_TYPES", "LAYER_KINDS", "MAX_LAYERS", "MAX_WIDTH"]

#: bounds on a config's integers, checked before anything is built from one (a config may come from
#: a file or a checkpoint's manifest): layer counts, and every other size or count
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 24
_LAYER_COUNTS = ("num_layers", "mtp_num_layers", "first_k_dense_replace")

ROPE_TYPES = ("rope", "yarn")
#: what a layer's token mixer is: softmax attention, or gated DeltaNet (Qwen3-Next's linear attention)
LAYER_KINDS = ("attention", "linear_attention")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. JSON-able through :meth:`to_dict` / :meth:`from_dict` (the checkpoint
    manifest stores it).

    Attention: ``num_query_groups`` = ``num_attention_heads`` is plain multi-head attention;
    ``kv_channels`` is the head dimension and may differ from ``hidden_size // num_attention_heads``.
    ``add_qkv_bias`` adds a bias to the fused QKV projection (Qwen2). With
    ``multi_latent_attention`` (DeepSeek-V2/V3) a layer compresses queries to ``q_lora_rank`` (0:
    no compression) and keys/values to ``kv_lora_rank``; each head has ``qk_head_dim`` query/key
    dimensions without RoPE, ``qk_pos_emb_head_dim`` with RoPE (the key's shared by all heads) and
    ``v_head_dim`` value dimensions; ``kv_channels`` and ``num_query_groups`` are then unused.
    ``rope_type="yarn"`` stretches RoPE by ``rotary_scaling_factor`` over
    ``original_max_position_embeddings`` (YaRN, with ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim`` as DeepSeek-V3 uses them).

    MoE: ``num_experts = 0`` is a dense model. Otherwise every layer from
    ``first_k_dense_replace`` on is an MoE layer (the first ones dense, with ``ffn_hidden_size``).
    ``moe_shared_expert_ffn_hidden_size = 0`` means no shared expert; ``moe_shared_expert_gate``
    scales the shared expert by a sigmoid gate (Qwen3-Next). Routing scores are softmax or sigmoid
    (``moe_score_func``); ``moe_router_pre_softmax`` (softmax only) keeps the top-k probabilities as
    they are instead of renormalising them (Qwen3-MoE with ``norm_topk_prob = false``). With
    ``moe_router_enable_expert_bias`` a non-trained per-expert bias is added to the scores when
    choosing (not weighting) the experts, and moved towards balance after every step by
    ``moe_router_bias_update_rate`` (DeepSeek-V3's auxiliary-loss-free balancing). With
    ``moe_router_num_groups > 0`` the experts are split into that many groups, each token first
    picks ``moe_router_group_topk`` groups (by the sum of each group's top
    ``moe_router_topk // moe_router_group_topk`` scores) and then its top-k experts among them.
    The chosen weights are multiplied by ``moe_router_topk_scaling_factor``.

    Multi-token prediction: ``mtp_num_layers`` extra layers, the k-th predicting the token k + 1
    positions beyond the next one, their loss weighted by ``mtp_loss_scaling_factor`` (averaged
    over the layers), as DeepSeek-V3 and Megatron-Core define them.

    Qwen3-Next: ``layer_kinds`` (empty: every layer attention) names each layer's token mixer;
    gated DeltaNet layers have ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of
    ``linear_key_head_dim`` / ``linear_value_head_dim`` and a causal convolution of
    ``linear_conv_kernel_dim``. ``attention_output_gate`` gates each attention head's output by a
    sigmoid of a second query projection; ``rotary_percent`` < 1 rotates only that fraction of each
    head; ``layernorm_zero_centered_gamma`` stores every RMSNorm weight as ``gamma - 1``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    qk_layernorm: bool = False
    tie_embeddings: bool = False
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_score_func: str = "softmax"
    moe_aux_loss_coeff: float = 1e-2
    moe_shared_expert_ffn_hidden_size: int = 0
    seq_length: int = 256
    add_qkv_bias: bool = False
    moe_router_pre_softmax: bool = False
    # multi-latent attention (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # RoPE scaling
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # MoE routing (DeepSeek-V3)
    first_k_dense_replace: int = 0
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_router_topk_scaling_factor: float = 1.0
    moe_shared_expert_gate: bool = False
    # multi-token prediction
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # Qwen3-Next
    layer_kinds: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attention_output_gate: bool = False
    rotary_percent: float = 1.0
    layernorm_zero_centered_gamma: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layer_kinds, (list, tuple)) or len(self.layer_kinds) > MAX_LAYERS:
            raise ValueError(f"GPTConfig.layer_kinds must be a list of at most {MAX_LAYERS} layer kinds")
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))  # a JSON list becomes a tuple
        self._check_types()
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "seq_length",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if not self.multi_latent_attention and self.rotary_dim % 2:
            raise ValueError(
                f"kv_channels * rotary_percent must be even for rotary embeddings, got {self.rotary_dim} "
                f"(kv_channels={self.kv_channels})"
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        self._check_mla()
        self._check_rope()
        self._check_moe()
        self._check_layer_kinds()
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")

    # ---- checks, by feature -----------------------------------------------------------------
    def _check_types(self) -> None:
        """Every field of its type (an integer is no bool, a number is finite) and within bounds, so
        that a config from a file or a manifest cannot ask for a model no machine holds."""
        for f in dataclasses.fields(self):
            value, problem = getattr(self, f.name), None
            if f.type == "int" and type(value) is not int:
                problem = "must be an integer"
            elif f.type == "int":
                bound = MAX_LAYERS if f.name in _LAYER_COUNTS else MAX_WIDTH
                problem = f"must be at most {bound}" if abs(value) > bound else None
            elif f.type == "float" and (type(value) not in (int, float) or not math.isfinite(value)):
                problem = "must be a finite number"
            elif f.type == "bool" and type(value) is not bool:
                problem = "must be true or false"
            elif f.type == "str" and type(value) is not str:
                problem = "must be a string"
            elif f.name == "layer_kinds" and not all(type(k) is str for k in value):
                problem = "must be a list of strings"
            if problem:
                raise ValueError(f"GPTConfig.{f.name} {problem}, got {str(value)[:40]}")

    def _check_mla(self) -> None:
        if not self.multi_latent_attention:
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"multi_latent_attention needs {name} > 0, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be >= 0 (0: no query compression), got {self.q_lora_rank}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim must be even for rotary embeddings, got {self.qk_pos_emb_head_dim}")
        if self.qk_layernorm or self.add_qkv_bias or self.attention_output_gate:
            raise ValueError("multi_latent_attention has no qk_layernorm, add_qkv_bias or attention_output_gate")

    def _check_rope(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        if self.rope_type == "yarn":
            if self.rotary_scaling_factor < 1.0:
                raise ValueError(f"rope_type='yarn' needs rotary_scaling_factor >= 1, got {self.rotary_scaling_factor}")
            if self.original_max_position_embeddings <= 0:
                raise ValueError("rope_type='yarn' needs original_max_position_embeddings > 0")

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace must be in [0, num_layers={self.num_layers}]")
        if self.has_dense_layers and self.ffn_hidden_size <= 0:
            raise ValueError("a model with dense layers needs ffn_hidden_size > 0")
        if self.moe_shared_expert_ffn_hidden_size < 0:
            raise ValueError("moe_shared_expert_ffn_hidden_size must be >= 0")
        if self.num_experts == 0:
            return
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"moe_router_topk must be in [1, num_experts={self.num_experts}], got {self.moe_router_topk}"
            )
        if self.moe_ffn_hidden_size <= 0:
            raise ValueError("an MoE model needs moe_ffn_hidden_size > 0")
        if self.moe_score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_score_func must be 'softmax' or 'sigmoid', got {self.moe_score_func!r}")
        if self.moe_router_pre_softmax and self.moe_score_func != "softmax":
            raise ValueError("moe_router_pre_softmax applies to softmax routing only")
        if self.moe_shared_expert_gate and self.moe_shared_expert_ffn_hidden_size == 0:
            raise ValueError("moe_shared_expert_gate needs a shared expert (moe_shared_expert_ffn_hidden_size > 0)")
        groups, picked = self.moe_router_num_groups, self.moe_router_group_topk
        if groups:
            if groups < 0 or self.num_experts % groups:
                raise ValueError(f"moe_router_num_groups ({groups}) must divide num_experts ({self.num_experts})")
            if not 1 <= picked <= groups:
                raise ValueError(f"moe_router_group_topk must be in [1, moe_router_num_groups={groups}], got {picked}")
            per_group = self.moe_router_topk // picked
            if not 1 <= per_group <= self.num_experts // groups or self.moe_router_topk % picked:
                raise ValueError(
                    f"moe_router_topk ({self.moe_router_topk}) must be moe_router_group_topk ({picked}) times a "
                    f"number of experts a group has (1..{self.num_experts // groups})"
                )
        elif picked:
            raise ValueError("moe_router_group_topk needs moe_router_num_groups > 0")

    def _check_layer_kinds(self) -> None:
        if not self.layer_kinds:
            return
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer_kinds: unknown kind(s) {', '.join(unknown)}; expected {', '.join(LAYER_KINDS)}")
        if "linear_attention" in self.layer_kinds:
            for name in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
            ):
                if getattr(self, name) <= 0:
                    raise ValueError(f"linear_attention layers need {name} > 0, got {getattr(self, name)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                    f"linear_num_key_heads ({self.linear_num_key_heads})"
                )
            if self.linear_conv_kernel_dim < 1:
                raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
            if self.multi_latent_attention:
                raise ValueError("linear_attention layers do not mix with multi_latent_attention")

    # ---- derived ----------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    @property
    def has_dense_layers(self) -> bool:
        return self.num_experts == 0 or self.first_k_dense_replace > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based; MTP layers count on from ``num_layers``) is an MoE layer."""
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    def layer_kind(self, layer: int) -> str:
        """Layer ``layer``'s token mixer (MTP layers are attention layers)."""
        return self.layer_kinds[layer] if layer < len(self.layer_kinds) else "attention"

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict of every field."""
        d = dataclasses.asdict(self)
        d["layer_kinds"] = list(self.layer_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Inverse of :meth:`to_dict`. Unknown keys are an error (a manifest written by a newer
        model would otherwise load silently into the wrong shape)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig key(s): {', '.join(unknown)}")
        return cls(**d)


# Every 2-D weight has a multiple of 32 rows (the block(32) sharding policy), except MoE routers
# whose row count is the number of experts.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        seq_length=128,
    ),
    "tiny-moe": GPTConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        seq_length=128,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_shared_expert_ffn_hidden_size=64,
    ),
    "llama-like-small": GPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=352,
        rotary_base=500000.0,
        norm_epsilon=1e-5,
        seq_length=256,
    ),
    "qwen3-like-small": GPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=32,
        ffn_hidden_size=384,
        rotary_base=1000000.0,
        norm_epsilon=1e-6,
        qk_layernorm=True,
        tie_embeddings=True,
        seq_length=256,
    ),
    "mixtral-like-small": GPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=352,
        rotary_base=1000000.0,
        norm_epsilon=1e-5,
        seq_length=256,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=224,
        moe_score_func="softmax",
    ),
    # DeepSeek-V3 in miniature: MLA, one dense layer then MoE with a shared expert, sigmoid routing
    # with an expert bias, 2 of 4 groups per token, one MTP layer
    "tiny-deepseek": GPTConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=4,
        kv_channels=32,
        ffn_hidden_size=128,
        seq_length=128,
        norm_epsilon=1e-6,
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_head_dim=32,
        qk_pos_emb_head_dim=32,
        v_head_dim=32,
        num_experts=8,
        moe_router_topk=4,
        moe_ffn_hidden_size=32,
        moe_shared_expert_ffn_hidden_size=32,
        moe_score_func="sigmoid",
        moe_aux_loss_coeff=0.0,
        first_k_dense_replace=1,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        mtp_num_layers=1,
    ),
}


def get_preset(name: str) -> GPTConfig:
    """The preset config called ``name``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
