"""Gated DeltaNet (Qwen3-Next's linear attention), with Megatron-Core's parameter names and
layout (``self_attention.in_proj`` with the layer's input norm fused in, ``conv1d``, ``dt_bias``,
``A_log``, ``out_norm``, ``out_proj``).

Per token ``x``: ``in_proj`` (after the fused RMSNorm) gives, in this order, queries and keys
(``linear_num_key_heads`` heads of ``linear_key_head_dim``), values and output gates z
(``linear_num_value_heads`` heads of ``linear_value_head_dim``), then per value head a
write-strength logit b and a decay logit a. Queries, keys and values pass a causal depthwise
convolution (``conv1d``, kernel ``linear_conv_kernel_dim``) and SiLU; queries and keys are
L2-normalised, queries scaled by ``1/sqrt(key_head_dim)``; each key head serves
``value_heads / key_heads`` consecutive value heads. With ``beta = sigmoid(b)`` and the decay
``exp(g)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, each value head keeps a state
``S [key_dim, value_dim]`` (zero at the start of a sequence)::

    S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

(the delta rule). The output is RMSNorm'ed per head (``out_norm``: weight stored as it is, as
transformers does, also when the other norms are zero-centered), times ``silu(z)``, then
``out_proj``. The recurrence runs token by token: simple and exact, and fast enough for the
sequence lengths this CPU reference trains on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core.models.config import GPTConfig
from mfsdp_core.models.layers import LayerNormLinear, Linear, param, rms_norm

__all__ = ["GatedDeltaNet", "gated_delta_rule", "in_proj_sizes"]


def in_proj_sizes(config: GPTConfig) -> list[int]:
    """Rows of ``in_proj`` for q, k, v, z, b, a, in that order."""
    c = config
    qk = c.linear_num_key_heads * c.linear_key_head_dim
    v = c.linear_num_value_heads * c.linear_value_head_dim
    return [qk, qk, v, v, c.linear_num_value_heads, c.linear_num_value_heads]


def _init_a_log(p: torch.Tensor) -> None:
    """``log(A)`` with A uniform in [0.01, 16] (away from 0), as transformers initialises it."""
    p.copy_(torch.empty_like(p).uniform_(0.01, 16).log_())


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The gated delta rule over ``q, k [b, t, heads, dk]``, ``v [b, t, heads, dv]``, decay logs
    ``g`` and write strengths ``beta`` ``[b, t, heads]`` (all fp32, q / k already normalised and
    scaled); returns ``o [b, t, heads, dv]``."""
    b, t, h, dk = k.shape
    state = v.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        k_i = k[:, i]
        delta = (v[:, i] - (state * k_i.unsqueeze(-1)).sum(dim=-2)) * beta[:, i].unsqueeze(-1)
        state = state + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, i].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """One layer's gated DeltaNet token mixer (see the module docstring); its input is the raw
    residual stream (the layer's input norm is fused into ``in_proj``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.key_heads, self.value_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.key_dim, self.value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.sizes = in_proj_sizes(c)
        self.eps = c.norm_epsilon
        self.in_proj = LayerNormLinear(
            c.hidden_size, sum(self.sizes), c.norm_epsilon, zero_centered=c.layernorm_zero_centered_gamma
        )
        conv_dim = sum(self.sizes[:3])
        self.kernel = c.linear_conv_kernel_dim
        self.conv1d = nn.Module()  # holds ``weight [conv_dim, 1, kernel]`` under MCore's name
        self.conv1d.weight = param(conv_dim, 1, self.kernel)
        self.dt_bias = param(self.value_heads, init="ones")
        self.A_log = param(self.value_heads, init=_init_a_log)
        self.out_norm = nn.Module()
        self.out_norm.weight = param(self.value_dim, init="ones")
        self.out_proj = Linear(self.value_heads * self.value_dim, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, z, beta_logit, a = self.in_proj(x).split(self.sizes, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [b, channels, t]
        qkv = F.conv1d(qkv, self.conv1d.weight, padding=self.kernel - 1, groups=qkv.shape[1])[..., :t]
        q, k, v = F.silu(qkv).transpose(1, 2).split(self.sizes[:3], dim=-1)
        q = q.reshape(b, t, self.key_heads, self.key_dim).float()
        k = k.reshape(b, t, self.key_heads, self.key_dim).float()
        v = v.reshape(b, t, self.value_heads, self.value_dim).float()
        per = self.value_heads // self.key_heads
        q, k = _l2norm(q), _l2norm(k)
        if per > 1:
            q, k = q.repeat_interleave(per, dim=2), k.repeat_interleave(per, dim=2)
        q = q / self.key_dim**0.5
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_rule(q, k, v, g, torch.sigmoid(beta_logit.float()))
        gate = z.reshape(b, t, self.value_heads, self.value_dim)
        out = rms_norm(out, self.out_norm.weight, self.eps) * F.silu(gate.float())
        return self.out_proj(out.to(x.dtype).reshape(b, t, self.value_heads * self.value_dim))
