"""Multi-latent attention (DeepSeek-V2/V3), with Megatron-Core's parameter names.

Per token ``x`` (already ``input_layernorm``-ed):

* queries: ``linear_q_down_proj`` to ``q_lora_rank``, RMSNorm (fused into ``linear_q_up_proj`` as
  its ``layer_norm_weight``), ``linear_q_up_proj`` to ``heads * (qk_head_dim +
  qk_pos_emb_head_dim)``; without query compression (``q_lora_rank = 0``) one ``linear_q_proj``;
* keys and values: ``linear_kv_down_proj`` to ``kv_lora_rank + qk_pos_emb_head_dim``; the first
  part is normed (``linear_kv_up_proj.layer_norm_weight``) and projected by ``linear_kv_up_proj``
  to ``heads * (qk_head_dim + v_head_dim)``; the second part is the RoPE key, one for all heads;
* each head's query / key is ``[no-RoPE part, RoPE part]``; RoPE rotates interleaved pairs
  (DeepSeek's layout); causal attention with scale ``(qk_head_dim + qk_pos_emb_head_dim)**-0.5``
  (YaRN's mscale correction applied when RoPE is stretched); ``linear_proj`` back to hidden.

The rows of every projection are laid out as Megatron-Core's MLA and DeepSeek's released
checkpoints lay them out (per head ``[nope; rope]`` for queries, ``[k_nope; v]`` for the
up-projected keys/values), so the Hugging Face and Megatron-Core bridges map them as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core.models.config import GPTConfig
from mfsdp_core.models.layers import LayerNormLinear, Linear, Rotary, apply_rope_pairs

__all__ = ["MLASelfAttention"]


class MLASelfAttention(nn.Module):
    """Causal multi-latent attention of one layer (see the module docstring)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        self.kv_rank = c.kv_lora_rank
        q_rows = self.heads * (self.nope + self.rope)
        if c.q_lora_rank > 0:
            self.linear_q_down_proj = Linear(c.hidden_size, c.q_lora_rank)
            self.linear_q_up_proj = LayerNormLinear(c.q_lora_rank, q_rows, c.norm_epsilon)
            self.linear_q_proj = None
        else:
            self.linear_q_down_proj = self.linear_q_up_proj = None
            self.linear_q_proj = Linear(c.hidden_size, q_rows)
        self.linear_kv_down_proj = Linear(c.hidden_size, c.kv_lora_rank + self.rope)
        self.linear_kv_up_proj = LayerNormLinear(c.kv_lora_rank, self.heads * (self.nope + self.v_dim), c.norm_epsilon)
        self.linear_proj = Linear(self.heads * self.v_dim, c.hidden_size)
        self.rotary = Rotary.of(c, self.rope)
        self.scale = self.rotary.softmax_scale(self.nope + self.rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.linear_q_down_proj(x))
        q = q.view(b, t, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)

        kv_down = self.linear_kv_down_proj(x)
        kv_latent, k_rope = kv_down.split([self.kv_rank, self.rope], dim=-1)
        kv = self.linear_kv_up_proj(kv_latent).view(b, t, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)

        cos, sin = self.rotary.cos_sin(t, x.device)
        q_rope = apply_rope_pairs(q_rope, cos, sin)
        k_rope = apply_rope_pairs(k_rope.view(b, 1, t, self.rope), cos, sin).expand(b, self.heads, t, self.rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.linear_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.v_dim))
