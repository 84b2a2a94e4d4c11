"""Reference decoder-only GPT models (dense and MoE) in plain PyTorch, with Megatron-Core
Transformer-Engine-spec parameter names, so that a checkpoint of these models reads like an MCore
one (``decoder.layers.3.self_attention.linear_qkv.weight``, ``…mlp.experts.linear_fc1.weight17``).

The architecture is the Llama / Qwen3 / Mixtral family: RMSNorm (computed in fp32) before
attention and MLP, fused QKV laid out per query group (GQA), rotary embeddings (rotate-half),
causal ``scaled_dot_product_attention``, SwiGLU MLPs with a fused ``[gate; up]`` first
projection, optional per-head q/k RMSNorm (Qwen3), and, when ``num_experts > 0``, a top-k routed
MoE in *every* layer with an optional shared expert. No biases, except optional q/k/v biases
(``add_qkv_bias``, Qwen2).

Module tree: ``model.decoder.layers`` is an ``nn.ModuleList`` of :class:`TransformerLayer`, so a
trainer can ``fully_shard`` each block and then the root.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core.expert_parallel import ExpertMesh
from mfsdp_core.token_dispatch import dispatch_and_run

__all__ = [
    "GPTConfig",
    "PRESETS",
    "get_preset",
    "GPTModel",
    "TransformerLayer",
    "MoELayer",
    "shard_units",
    "shard_experts",
    "linear_weights",
]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. JSON-able through :meth:`to_dict` / :meth:`from_dict` (the checkpoint
    manifest stores it).

    ``num_query_groups`` = ``num_attention_heads`` is plain multi-head attention; ``kv_channels``
    is the head dimension and may differ from ``hidden_size // num_attention_heads``.
    ``num_experts = 0`` is a dense model; otherwise every layer is an MoE layer and
    ``ffn_hidden_size`` is unused. ``moe_shared_expert_ffn_hidden_size = 0`` means no shared expert.

    ``add_qkv_bias`` adds a bias to the fused QKV projection (``linear_qkv.bias``, laid out per
    query group like the weight; Qwen2). ``moe_router_pre_softmax`` (MCore's flag of that name)
    keeps the top-k softmax probabilities as they are instead of renormalising them to sum to 1
    (Qwen3-MoE with ``norm_topk_prob = false``); softmax routing only. Both default to off, which
    is the behaviour of every model before they existed; ``from_dict`` fills them in for old
    manifests.
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

    def __post_init__(self) -> None:
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
        if self.kv_channels % 2:
            raise ValueError(f"kv_channels must be even for rotary embeddings, got {self.kv_channels}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts == 0 and self.ffn_hidden_size <= 0:
            raise ValueError("a dense model needs ffn_hidden_size > 0")
        if self.num_experts > 0:
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
        if self.moe_shared_expert_ffn_hidden_size < 0:
            raise ValueError("moe_shared_expert_ffn_hidden_size must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

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
}


def get_preset(name: str) -> GPTConfig:
    """The preset config called ``name``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


# --------------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (weight included), returned in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _param(*shape: int) -> nn.Parameter:
    # Values are filled by GPTModel.reset_parameters, in registration order.
    return nn.Parameter(torch.empty(*shape))


class RMSNorm(nn.Module):
    """RMSNorm with a single ``weight`` (MCore ``TENorm`` naming)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """Bias-free linear layer: ``y = x @ weight.T`` (``weight`` is ``[out, in]``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LayerNormLinear(nn.Module):
    """RMSNorm fused in front of a linear (MCore ``TELayerNormColumnParallelLinear``): parameters
    ``layer_norm_weight`` and ``weight``, and ``bias`` when asked (none by default)."""

    def __init__(self, in_features: int, out_features: int, eps: float, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(out_features, in_features)
        self.layer_norm_weight = _param(in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``fc1_out`` is the fused ``[gate; up]`` projection output."""
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(seq_len: int, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` tables ``[seq_len, dim]`` for rotate-half RoPE (frequencies repeated
    over the two halves)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [b, heads, t, d]``, computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Causal GQA self-attention with a fused, per-query-group QKV projection.

    ``linear_qkv.weight`` rows, for each query group g in order: the group's
    ``heads / groups`` q heads, then its k head, then its v head, ``kv_channels`` rows each
    (MCore's layout). Query head h attends with k/v of group ``h // (heads / groups)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.groups, self.head_dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
        self.rotary_base = c.rotary_base
        qkv_rows = self.groups * (self.heads // self.groups + 2) * self.head_dim
        self.linear_qkv = LayerNormLinear(c.hidden_size, qkv_rows, c.norm_epsilon, bias=c.add_qkv_bias)
        if c.qk_layernorm:
            self.q_layernorm = RMSNorm(self.head_dim, c.norm_epsilon)
            self.k_layernorm = RMSNorm(self.head_dim, c.norm_epsilon)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = Linear(self.heads * self.head_dim, c.hidden_size)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [b, t, hidden]`` -> q ``[b, heads, t, d]``, k and v ``[b, groups, t, d]``, after the
        optional q/k norm and RoPE (k/v not yet repeated for GQA)."""
        b, t, _ = x.shape
        per_group = self.heads // self.groups
        qkv = self.linear_qkv(x).view(b, t, self.groups, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(b, t, self.heads, self.head_dim)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope_cos_sin(t, self.head_dim, self.rotary_base, x.device)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        per_group = self.heads // self.groups
        if per_group > 1:
            k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    """Dense SwiGLU MLP with the input RMSNorm fused into ``linear_fc1`` (rows ``[gate; up]``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.linear_fc1 = LayerNormLinear(config.hidden_size, 2 * config.ffn_hidden_size, config.norm_epsilon)
        self.linear_fc2 = Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class SharedExpertMLP(nn.Module):
    """SwiGLU MLP without a fused norm (its input is already ``pre_mlp_layernorm``-ed)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = Linear(hidden, 2 * ffn)
        self.linear_fc2 = Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class ExpertWeights(nn.Module):
    """Holds one weight per expert as parameters ``weight0``, ``weight1``, … (MCore
    ``TEGroupedLinear`` naming, global expert index). Under expert parallelism only the experts
    ``local`` of this rank remain, still under their global index."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.local = range(num_experts)
        for e in range(num_experts):
            self.register_parameter(f"weight{e}", _param(out_features, in_features))

    def __getitem__(self, e: int) -> torch.Tensor:
        return getattr(self, f"weight{e}")

    def keep_only(self, local: range) -> None:
        """Drop every expert's weight but those of ``local`` (global indices)."""
        for e in range(self.num_experts):
            if e not in local:
                delattr(self, f"weight{e}")
        self.local = local


class Experts(nn.Module):
    """The routed SwiGLU experts: ``linear_fc1.weight{e}`` ``[2 * moe_ffn, hidden]`` and
    ``linear_fc2.weight{e}`` ``[hidden, moe_ffn]``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = ExpertWeights(num_experts, 2 * ffn, hidden)
        self.linear_fc2 = ExpertWeights(num_experts, hidden, ffn)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x [n, hidden]``; ``n`` may be 0."""
        return F.linear(swiglu(F.linear(x, self.linear_fc1[e])), self.linear_fc2[e])


class Router(nn.Module):
    """Linear router, ``weight [num_experts, hidden]``; logits are computed in fp32."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = _param(num_experts, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert, on already-normed input.

    Routing, per token:
      * ``softmax``: probabilities = softmax(logits) over all experts; take the top-k and
        **renormalise** them to sum to 1 (equals MCore's default top-k-then-softmax and Mixtral);
        with ``moe_router_pre_softmax`` the top-k probabilities are used as they are
        (Qwen3-MoE with ``norm_topk_prob = false``).
      * ``sigmoid``: scores = sigmoid(logits); take the top-k; renormalise them to sum to 1 when
        k > 1 (MCore / DeepSeek-V3).
    The output is ``sum_k weight_k * expert_k(x)`` (+ ``shared_experts(x)``).

    Load-balancing loss (Switch-style, as MCore's ``aux_loss``): with N tokens,
    ``f_e = (#assignments to e) / (N * k)`` and ``P_e = mean over tokens of the full score
    distribution`` (softmax probabilities; for sigmoid the scores normalised per token),
    ``aux = moe_aux_loss_coeff * E * sum_e f_e * P_e`` (equals the coefficient when perfectly
    balanced). It is stored in ``self.aux_loss`` on every forward, with ``self.tokens_per_expert``.

    Every expert runs on every forward, on its possibly empty token subset: an empty matmul still
    connects the expert's weights to the graph, so they receive a (zero) gradient, which a sharded
    runtime needs on every rank.

    Under expert parallelism (:meth:`use_expert_parallel`) this rank holds only its experts; routing,
    aux loss and ``tokens_per_expert`` stay computed on this rank's tokens, exactly as above, and
    the routed tokens travel to their experts' ranks and back (:mod:`mfsdp_core.token_dispatch`).
    ``tokens_received`` then counts, per local expert, the rows it processed from the whole EP
    group.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.num_experts, self.topk = c.num_experts, c.moe_router_topk
        self.score_func, self.aux_loss_coeff = c.moe_score_func, c.moe_aux_loss_coeff
        self.pre_softmax = c.moe_router_pre_softmax
        self.router = Router(c.num_experts, c.hidden_size)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_ffn_hidden_size)
        if c.moe_shared_expert_ffn_hidden_size > 0:
            self.shared_experts = SharedExpertMLP(c.hidden_size, c.moe_shared_expert_ffn_hidden_size)
        else:
            self.shared_experts = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.tokens_received: torch.Tensor | None = None
        self.ep_group = None
        self.ep_rank = 0
        self.ep_size = 1

    def use_expert_parallel(self, mesh: ExpertMesh) -> None:
        """Keep only this rank's experts (``mesh.local_experts``) and dispatch tokens over its EP
        group. Call before ``fully_shard``."""
        if self.num_experts % mesh.ep_size:
            raise ValueError(f"EP size {mesh.ep_size} does not divide the number of experts {self.num_experts}")
        for weights in (self.experts.linear_fc1, self.experts.linear_fc2):
            weights.keep_only(mesh.local_experts(self.num_experts))
        self.ep_group, self.ep_rank, self.ep_size = mesh.ep_group, mesh.ep_rank, mesh.ep_size

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [n, hidden]`` -> (top-k weights ``[n, k]`` fp32, top-k expert indices ``[n, k]``,
        full per-token distribution ``[n, E]`` fp32 used by the aux loss)."""
        logits = self.router(x)
        if self.score_func == "softmax":
            dist = torch.softmax(logits, dim=-1)
            top_w, top_idx = torch.topk(dist, self.topk, dim=-1)
            if not self.pre_softmax:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        else:
            scores = torch.sigmoid(logits)
            top_w, top_idx = torch.topk(scores, self.topk, dim=-1)
            if self.topk > 1:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            dist = scores / scores.sum(dim=-1, keepdim=True)
        return top_w, top_idx, dist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        top_w, top_idx, dist = self.route(x)

        if self.ep_size > 1:
            sent = dispatch_and_run(x, top_idx, self.num_experts, self.ep_group, self.ep_rank, self.experts.expert)
            weights = top_w[sent.token, sent.slot].unsqueeze(-1).to(sent.outputs.dtype)
            out = torch.zeros_like(x).index_add(0, sent.token, sent.outputs * weights)
            self.tokens_received = sent.received.sum(0)
        else:
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                token, slot = torch.where(top_idx == e)  # tokens in order; possibly empty
                y = self.experts.expert(e, x[token])
                out = out.index_add(0, token, y * top_w[token, slot].unsqueeze(-1).to(y.dtype))
            self.tokens_received = torch.bincount(top_idx.flatten(), minlength=self.num_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        counts = torch.bincount(top_idx.flatten(), minlength=self.num_experts)
        f = counts.float() / (n * self.topk)
        self.aux_loss = self.aux_loss_coeff * self.num_experts * (f * dist.mean(dim=0)).sum()
        self.tokens_per_expert = counts.detach()
        return out.view(shape)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + attn(x)``, then ``x + mlp(x)``. Dense layers fuse the MLP norm into
    ``mlp.linear_fc1``; MoE layers have a separate ``pre_mlp_layernorm``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.self_attention = SelfAttention(config)
        if config.num_experts > 0:
            self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon)
            self.mlp: nn.Module = MoELayer(config)
        else:
            self.pre_mlp_layernorm = None
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(x)
        h = self.pre_mlp_layernorm(x) if self.pre_mlp_layernorm is not None else x
        return x + self.mlp(h)


class Embedding(nn.Module):
    """Token embedding table ``word_embeddings.weight [vocab, hidden]`` (no position embedding:
    positions come from RoPE)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)


class Decoder(nn.Module):
    """``layers`` (an ``nn.ModuleList``) then ``final_layernorm``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class GPTModel(nn.Module):
    """Decoder-only GPT: ``forward(tokens [b, t]) -> fp32 logits [b, t, vocab]``.

    MoE models also leave ``self.aux_loss`` (a scalar tensor in the graph: the sum over MoE layers
    of their load-balancing loss, coefficient included, from the last forward) for the trainer to
    add to its loss; it is a zero tensor for dense models. Keeping it off the return value keeps
    ``forward`` a plain tensor-to-tensor function for sharding wrappers.

    Initialisation is deterministic under ``torch.manual_seed``: in parameter-registration order,
    every 2-D weight is drawn from N(0, 0.02²), every norm weight set to 1 and every bias to 0.
    ``output_layer`` is absent when ``tie_embeddings`` (the embedding table is reused).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.hidden_size)
        self.decoder = Decoder(config)
        self.output_layer = None if config.tie_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02²) for 2-D weights, ones for norm weights, zeros for biases, in registration
        order. Nothing to fill on the meta device (plans and shapes only)."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.seq_length:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds seq_length {self.config.seq_length}")
        h = self.decoder(self.embedding(tokens))
        head = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        logits = F.linear(h, head).float()
        moe = [layer.mlp.aux_loss for layer in self.decoder.layers if isinstance(layer.mlp, MoELayer)]
        self.aux_loss = torch.stack(moe).sum() if moe else torch.zeros((), device=logits.device)
        return logits


def shard_experts(model: GPTModel, mesh: ExpertMesh) -> GPTModel:
    """Expert parallelism for ``model``: each MoE layer keeps this rank's experts (global names)
    and dispatches tokens over ``mesh``'s EP group. Build the whole model on every rank from the
    same seed first, so that every expert starts as in the single-process model; then call this,
    then ``fully_shard`` with ``mesh.groups`` and ``expert_placement()``."""
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.use_expert_parallel(mesh)
    return model


def linear_weights(model: GPTModel) -> list[nn.Parameter]:
    """The weights of the transformer layers' linear projections (QKV, output projection, MLP and
    expert ``fc1`` / ``fc2``, shared experts'): what ``--mxfp8`` stores as MXFP8. Not the routers
    (one row per expert), norms, embedding or output layer."""
    out = []
    for layer in model.decoder.layers:
        for module in layer.modules():
            if isinstance(module, (Linear, LayerNormLinear)):
                out.append(module.weight)
            elif isinstance(module, ExpertWeights):
                out.extend(module[e] for e in module.local)
    return out


def shard_units(model: GPTModel) -> list[nn.Module]:
    """The modules to ``fully_shard``, inner first: each decoder layer, then the root (which takes
    the embedding, the final norm and the output layer). ``cli.train`` shards this way, and the
    Hugging Face import records the plan of these units (``mfsdp_core.plan_model``)."""
    return [*model.decoder.layers, model]
