"""Multi-token prediction (DeepSeek-V3; Megatron-Core's ``MultiTokenPredictionBlock``), with
Megatron-Core's parameter names (``mtp.layers.{k}.enorm / hnorm / eh_proj / transformer_layer /
final_layernorm``).

Depth k (0-based) predicts, at position t, the token ``k + 2`` positions on (the main model
predicts the next one). Its input at t is the previous depth's hidden state at t (the main
model's final-normed output for k = 0) and the embedding of token ``t + k + 1``:
``eh_proj([enorm(embedding); hnorm(hidden)])``, then one transformer layer, then
``final_layernorm``; the shared output head gives its logits. As in Megatron-Core, the token ids
are shifted left once per depth with the vacated positions filled with token 0, and the labels
shifted alike, with those positions left out of the loss. The loss is the mean cross-entropy per
depth, averaged over the depths and weighted by ``mtp_loss_scaling_factor``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core.models.config import GPTConfig
from mfsdp_core.models.layers import Linear, RMSNorm

__all__ = ["MTPLayer", "MultiTokenPrediction", "shift_left"]


def shift_left(t: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    """``t [b, s]`` moved one position left along the sequence, the last position ``fill``."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = fill
    return out


class MTPLayer(nn.Module):
    """One prediction depth; ``layer`` is its transformer layer (built by the model, with the
    decoder's layer class)."""

    def __init__(self, config: GPTConfig, layer: nn.Module) -> None:
        super().__init__()
        c = config
        zc = c.layernorm_zero_centered_gamma
        self.enorm = RMSNorm(c.hidden_size, c.norm_epsilon, zc)
        self.hnorm = RMSNorm(c.hidden_size, c.norm_epsilon, zc)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size)
        self.transformer_layer = layer
        self.final_layernorm = RMSNorm(c.hidden_size, c.norm_epsilon, zc)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(self.transformer_layer(x))


class MultiTokenPrediction(nn.Module):
    """The model's MTP layers (``layers``, an ``nn.ModuleList``, one ``fully_shard`` unit each)."""

    def __init__(self, config: GPTConfig, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.scaling = config.mtp_loss_scaling_factor
        self.layers = nn.ModuleList(
            MTPLayer(config, make_layer(config.num_layers + k)) for k in range(config.mtp_num_layers)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The weighted MTP loss (a scalar in the graph) for the main model's final-normed
        ``hidden [b, s, h]`` on ``tokens [b, s]`` with next-token ``labels [b, s]``."""
        mask = torch.ones_like(labels, dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            tokens, labels, mask = shift_left(tokens), shift_left(labels), shift_left(mask)
            hidden = layer(hidden, embed(tokens))
            logits = head(hidden).float()
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
            total = total + (losses * mask.reshape(-1)).sum() / mask.sum().clamp(min=1.0)
        return total * (self.scaling / max(len(self.layers), 1))
