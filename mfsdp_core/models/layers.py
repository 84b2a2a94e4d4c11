"""The building blocks of the reference models: norms, bias-free linears (with Megatron-Core's
Transformer-Engine names), SwiGLU, and rotary position embeddings (plain, partial, interleaved
pairs, YaRN).

Parameters are created empty; :func:`init_parameters` fills them in registration order, each by
the rule it was created with (``param(..., init=...)``): so the random draws, and the weights of
a seeded model, do not depend on how the modules are spread over files.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "INIT_STD",
    "param",
    "init_parameters",
    "rms_norm",
    "RMSNorm",
    "Linear",
    "LayerNormLinear",
    "swiglu",
    "Rotary",
    "apply_rope",
    "apply_rope_pairs",
]

INIT_STD = 0.02
_INIT_ATTR = "_mfsdp_init"


def param(*shape: int, init: str | Callable[[torch.Tensor], None] | None = None) -> nn.Parameter:
    """An empty parameter filled later by :func:`init_parameters`: ``init`` is ``"normal"``
    (N(0, 0.02²)), ``"ones"``, ``"zeros"``, or a function filling the tensor in place; None: by
    shape (2-D and up normal, 1-D ones)."""
    p = nn.Parameter(torch.empty(*shape))
    if init is not None:
        setattr(p, _INIT_ATTR, init)
    return p


@torch.no_grad()
def init_parameters(module: nn.Module) -> None:
    """Fill every parameter of ``module`` by its rule, in registration order. Nothing to fill on
    the meta device (plans and shapes only)."""
    for name, p in module.named_parameters():
        if p.is_meta:
            continue
        rule = getattr(p, _INIT_ATTR, None)
        if rule is None:
            rule = "zeros" if name.endswith(".bias") else "ones" if p.ndim == 1 else "normal"
        if rule == "normal":
            p.normal_(0.0, INIT_STD)
        elif rule == "ones":
            p.fill_(1.0)
        elif rule == "zeros":
            p.zero_()
        else:
            rule(p)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (weight included), returned in ``x.dtype``;
    ``zero_centered``: the weight stores ``gamma - 1``."""
    xf = x.float()
    gamma = weight.float() + 1.0 if zero_centered else weight.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a single ``weight`` (MCore ``TENorm`` naming)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = param(dim, init="zeros" if zero_centered else "ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


class Linear(nn.Module):
    """Bias-free linear layer: ``y = x @ weight.T`` (``weight`` is ``[out, in]``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LayerNormLinear(nn.Module):
    """RMSNorm fused in front of a linear (MCore ``TELayerNormColumnParallelLinear``): parameters
    ``layer_norm_weight`` and ``weight``, and ``bias`` when asked (none by default)."""

    def __init__(
        self, in_features: int, out_features: int, eps: float, bias: bool = False, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = param(out_features, in_features)
        self.layer_norm_weight = param(in_features, init="zeros" if zero_centered else "ones")
        self.bias = param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps, self.zero_centered), self.weight, self.bias)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``fc1_out`` is the fused ``[gate; up]`` projection output."""
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------------------------------
# Rotary position embeddings


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not stretched)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


class Rotary:
    """The RoPE tables of one model: ``dim`` rotated dimensions per head, base ``base``, plain or
    YaRN-stretched (``factor`` over ``original_max``, with ``beta_fast`` / ``beta_slow`` bounding
    the ramp between interpolated and extrapolated frequencies, as in YaRN and DeepSeek-V3).

    ``attention_scale``: the factor YaRN multiplies cos / sin by; ``softmax_scale(d)``: the
    scale of ``q·k`` for head dimension ``d`` (``d**-0.5``, times ``mscale(factor,
    mscale_all_dim)²`` under YaRN when ``mscale_all_dim`` is set)."""

    def __init__(
        self,
        dim: int,
        base: float,
        *,
        yarn: bool = False,
        factor: float = 1.0,
        original_max: int = 0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
    ) -> None:
        self.dim, self.base, self.yarn, self.factor = dim, base, yarn, factor
        self.original_max, self.beta_fast, self.beta_slow = original_max, beta_fast, beta_slow
        self.mscale, self.mscale_all_dim = mscale, mscale_all_dim
        self.attention_scale = 1.0
        if yarn:
            if mscale and mscale_all_dim:
                self.attention_scale = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                self.attention_scale = _yarn_mscale(factor)

    @classmethod
    def of(cls, config, dim: int) -> "Rotary":
        """The tables ``config`` (a GPTConfig) describes for ``dim`` rotated dimensions."""
        return cls(
            dim,
            config.rotary_base,
            yarn=config.rope_type == "yarn",
            factor=config.rotary_scaling_factor,
            original_max=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
            mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim,
        )

    def softmax_scale(self, head_dim: int) -> float:
        scale = head_dim**-0.5
        if self.yarn and self.mscale_all_dim:
            m = _yarn_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        dim, base = self.dim, self.base
        pos = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        if not self.yarn:
            return 1.0 / pos

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        extrapolated = 1.0 - ramp
        return (1.0 / (self.factor * pos)) * (1 - extrapolated) + (1.0 / pos) * extrapolated

    def cos_sin(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos``/``sin`` tables ``[seq_len, dim]`` for rotate-half RoPE (frequencies repeated
        over the two halves), YaRN's ``attention_scale`` applied."""
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), self.inv_freq(device))
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scale != 1.0:
            cos, sin = cos * self.attention_scale, sin * self.attention_scale
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of ``x [b, heads, t, d]`` (the rest
    pass through), computed in fp32, returned in ``x.dtype``."""
    rot = cos.shape[-1]
    xf = x.float()
    head, tail = xf[..., :rot], xf[..., rot:]
    x1, x2 = head.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = head * cos + rotated * sin
    return (torch.cat([out, tail], dim=-1) if tail.shape[-1] else out).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [b, heads, t, d]`` whose dims are interleaved pairs ``(x0, x1), (x2, x3), …``,
    each rotated by one frequency (DeepSeek's MLA layout, as Megatron-Core's MLA and
    transformers' ``rope_interleave`` apply it); the output lists the first elements of the
    pairs, then the second ones. Computed in fp32, returned in ``x.dtype``."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
