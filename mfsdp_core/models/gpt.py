"""Reference decoder-only GPT models (dense and MoE) in plain PyTorch, with Megatron-Core
Transformer-Engine-spec parameter names, so that a checkpoint of these models reads like an MCore
one (``decoder.layers.3.self_attention.linear_qkv.weight``, ``…mlp.experts.linear_fc1.weight17``).

The architecture is the Llama / Qwen3 / Mixtral family: RMSNorm (computed in fp32) before
attention and MLP, fused QKV laid out per query group (GQA), rotary embeddings (rotate-half),
causal ``scaled_dot_product_attention``, SwiGLU MLPs with a fused ``[gate; up]`` first
projection, optional per-head q/k RMSNorm (Qwen3), and top-k routed MoE layers with an optional
shared expert. No biases, except optional q/k/v biases (``add_qkv_bias``, Qwen2). The config
(:mod:`mfsdp_core.models.config`) also builds DeepSeek-V3 (multi-latent attention,
:mod:`~mfsdp_core.models.mla`; sigmoid routing with an expert bias and groups,
:mod:`~mfsdp_core.models.moe`; multi-token prediction, :mod:`~mfsdp_core.models.mtp`) and
Qwen3-Next (gated DeltaNet layers, :mod:`~mfsdp_core.models.deltanet`; gated attention with
partial RoPE; zero-centered norms; a gated shared expert).

Module tree: ``model.decoder.layers`` (and ``model.mtp.layers``) are ``nn.ModuleList`` s of
:class:`TransformerLayer`, so a trainer can ``fully_shard`` each block and then the root.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core.expert_parallel import ExpertMesh
from mfsdp_core.models.config import PRESETS, GPTConfig, get_preset
from mfsdp_core.models.deltanet import GatedDeltaNet
from mfsdp_core.models.layers import (
    INIT_STD,
    LayerNormLinear,
    Linear,
    RMSNorm,
    Rotary,
    apply_rope,
    init_parameters,
    rms_norm,
    swiglu,
)
from mfsdp_core.models.mla import MLASelfAttention
from mfsdp_core.models.moe import ExpertWeights, MoELayer
from mfsdp_core.models.mtp import MultiTokenPrediction

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
    "rms_norm",
    "INIT_STD",
]


class SelfAttention(nn.Module):
    """Causal GQA self-attention with a fused, per-query-group QKV projection.

    ``linear_qkv.weight`` rows, for each query group g in order: the group's
    ``heads / groups`` q heads, (with ``attention_output_gate``: as many gate heads,) then its k
    head, then its v head, ``kv_channels`` rows each (MCore's layout). Query head h attends with
    k/v of group ``h // (heads / groups)``. RoPE rotates the first ``rotary_percent`` of each
    head; the gate scales each head's output by ``sigmoid(gate)`` before ``linear_proj``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.groups, self.head_dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
        self.gated = c.attention_output_gate
        per_group = self.heads // self.groups
        qkv_rows = self.groups * (per_group * (2 if self.gated else 1) + 2) * self.head_dim
        zc = c.layernorm_zero_centered_gamma
        self.linear_qkv = LayerNormLinear(
            c.hidden_size, qkv_rows, c.norm_epsilon, bias=c.add_qkv_bias, zero_centered=zc
        )
        if c.qk_layernorm:
            self.q_layernorm = RMSNorm(self.head_dim, c.norm_epsilon, zc)
            self.k_layernorm = RMSNorm(self.head_dim, c.norm_epsilon, zc)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = Linear(self.heads * self.head_dim, c.hidden_size)
        self.rotary = Rotary.of(c, c.rotary_dim)
        self.scale = self.rotary.softmax_scale(self.head_dim)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [b, t, hidden]`` -> q ``[b, heads, t, d]``, k and v ``[b, groups, t, d]``, after the
        optional q/k norm and RoPE (k/v not yet repeated for GQA)."""
        return self._project(x)[:3]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`project_qkv`, and the output gate ``[b, t, heads, d]`` (None without one)."""
        b, t, _ = x.shape
        per_group = self.heads // self.groups
        q_heads = per_group * (2 if self.gated else 1)
        qkv = self.linear_qkv(x).view(b, t, self.groups, q_heads + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(b, t, self.heads, self.head_dim)
        gate = qkv[:, :, :, per_group:q_heads].reshape(b, t, self.heads, self.head_dim) if self.gated else None
        k, v = qkv[:, :, :, q_heads], qkv[:, :, :, q_heads + 1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary.cos_sin(t, x.device)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, gate = self._project(x)
        per_group = self.heads // self.groups
        if per_group > 1:
            k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)
        if gate is not None:
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.linear_proj(out.reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    """Dense SwiGLU MLP with the input RMSNorm fused into ``linear_fc1`` (rows ``[gate; up]``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        zc = config.layernorm_zero_centered_gamma
        self.linear_fc1 = LayerNormLinear(
            config.hidden_size, 2 * config.ffn_hidden_size, config.norm_epsilon, zero_centered=zc
        )
        self.linear_fc2 = Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm block ``layer`` (0-based; MTP layers count on from ``num_layers``): ``x +
    mixer(x)``, then ``x + mlp(x)``. Attention fuses its norm into ``linear_qkv``, gated
    DeltaNet into ``in_proj``; multi-latent attention has a separate ``input_layernorm``. Dense layers fuse the MLP
    norm into ``mlp.linear_fc1``; MoE layers have a separate ``pre_mlp_layernorm``."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        c, zc = config, config.layernorm_zero_centered_gamma
        if c.layer_kind(layer) == "linear_attention":
            self.input_layernorm = None  # fused into the DeltaNet's in_proj
            self.self_attention: nn.Module = GatedDeltaNet(c)
        elif c.multi_latent_attention:
            self.input_layernorm = RMSNorm(c.hidden_size, c.norm_epsilon, zc)
            self.self_attention = MLASelfAttention(c)
        else:
            self.input_layernorm = None
            self.self_attention = SelfAttention(c)
        if c.is_moe_layer(layer):
            self.pre_mlp_layernorm = RMSNorm(c.hidden_size, c.norm_epsilon, zc)
            self.mlp: nn.Module = MoELayer(c)
        else:
            self.pre_mlp_layernorm = None
            self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attention(h)
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
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, config.layernorm_zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class GPTModel(nn.Module):
    """Decoder-only GPT: ``forward(tokens [b, t], labels=None) -> fp32 logits [b, t, vocab]``.

    The model also leaves ``self.aux_loss``: a scalar tensor in the graph for the trainer to add
    to its loss (zero when there is nothing to add): the sum over MoE layers of their
    load-balancing loss (coefficient included) and, with MTP layers and ``labels`` (the next
    token of each position, ``[b, t]``), the weighted MTP loss (:mod:`mfsdp_core.models.mtp`).
    Without ``labels`` the MTP layers do not run. Keeping it off the return value keeps
    ``forward`` a plain tensor-to-tensor function for sharding wrappers.

    Initialisation is deterministic under ``torch.manual_seed``: in parameter-registration order,
    every 2-D weight is drawn from N(0, 0.02²), every norm weight set to 1 (0 when stored
    zero-centered), every bias and expert bias to 0, gated DeltaNet's decay parameters as
    transformers' Qwen3-Next sets them. ``output_layer`` is absent when ``tie_embeddings`` (the
    embedding table is reused).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.hidden_size)
        self.decoder = Decoder(config)
        self.output_layer = None if config.tie_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.mtp = (
            MultiTokenPrediction(config, lambda layer: TransformerLayer(config, layer))
            if config.mtp_num_layers
            else None
        )
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter by its rule, in registration order (see the class docstring)."""
        init_parameters(self)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states."""
        weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(h, weight).float()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.seq_length:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds seq_length {self.config.seq_length}")
        h = self.decoder(self.embedding(tokens))
        logits = self.head(h)
        ran = list(self.decoder.layers)
        losses = []
        if self.mtp is not None and labels is not None:
            losses.append(self.mtp(h, tokens, labels, self.embedding, self.head))
            ran += [m.transformer_layer for m in self.mtp.layers]
        losses += [layer.mlp.aux_loss for layer in ran if isinstance(layer.mlp, MoELayer)]
        self.aux_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=logits.device)
        return logits


def _layers(model: GPTModel) -> list[TransformerLayer]:
    """The decoder's layers, then the MTP layers' transformer layers."""
    mtp = [m.transformer_layer for m in model.mtp.layers] if model.mtp is not None else []
    return [*model.decoder.layers, *mtp]


def shard_experts(model: GPTModel, mesh: ExpertMesh) -> GPTModel:
    """Expert parallelism for ``model``: each MoE layer keeps this rank's experts (global names)
    and dispatches tokens over ``mesh``'s EP group. Build the whole model on every rank from the
    same seed first, so that every expert starts as in the single-process model; then call this,
    then ``fully_shard`` with ``mesh.groups`` and ``expert_placement()``."""
    for layer in _layers(model):
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.use_expert_parallel(mesh)
    return model


def linear_weights(model: GPTModel) -> list[nn.Parameter]:
    """The weights of the transformer layers' linear projections (QKV or MLA projections,
    output projection, MLP and expert ``fc1`` / ``fc2``, shared experts'): what ``--mxfp8``
    stores as MXFP8. Not the routers (one row per expert), gates, norms, embedding, output layer
    or gated DeltaNet's projections."""
    out = []
    for layer in _layers(model):
        if isinstance(layer.self_attention, GatedDeltaNet):
            modules = list(layer.mlp.modules())
        else:
            modules = list(layer.modules())
        for module in modules:
            if isinstance(module, (Linear, LayerNormLinear)):
                out.append(module.weight)
            elif isinstance(module, ExpertWeights):
                out.extend(module[e] for e in module.local)
    return out


def shard_units(model: GPTModel) -> list[nn.Module]:
    """The modules to ``fully_shard``, inner first: each decoder layer, each MTP layer, then the
    root (which takes the embedding, the final norm and the output layer). ``cli.train`` shards
    this way, and the Hugging Face import records the plan of these units
    (``mfsdp_core.plan_model``)."""
    mtp = list(model.mtp.layers) if model.mtp is not None else []
    return [*model.decoder.layers, *mtp, model]
