"""MXFP8 quantize / dequantize in pure PyTorch: the ground truth for the native cast kernels.

Format (OCP Microscaling v1.0). A block of ``BLOCK = 32`` consecutive elements shares one scale,
a power of two stored as an E8M0 byte (its biased exponent, bias 127; ``0xFF`` is NaN). Elements
are FP8: E4M3 (``torch.float8_e4m3fn``, max 448, largest power of two 2^8) or E5M2
(``torch.float8_e5m2``, max 57344, largest power of two 2^15). ``axis="row"`` blocks run along a
row (1×32, the forward cast): scale plane ``[M, K/32]``; ``axis="col"`` blocks run down a column
(32×1, the backward cast): scale plane ``[M/32, K]``. Data keeps the orientation of the input
(``[M, K]`` both ways, never transposed); scale planes are compact (no padding, no swizzle) and
typed ``torch.float8_e8m0fnu`` (``.view(torch.uint8)`` for the wire).

The rules below are torchao's ``torchao.prototype.mx_formats.mx_tensor.to_mx`` (0.18.0) for
float32 input, reproduced bit for bit (tests/mfsdp_core/test_mx.py compares against it). ``amax``
is the largest ``|x|`` of a block; it is NaN when the block holds a NaN (NaN wins over inf).

``floor`` (OCP MX v1.0: shared exponent = floor(log2 amax) - emax_elem)
    - The exponent is read from amax's float32 bits, never computed in floating point: biased
      exponent field ``E = (bits >> 23) & 0xFF``; scale byte ``= clamp(E - emax_elem, 0, 254)``.
      A cast to e8m0 would round the mantissa; this truncates it, which is ``floor``.
    - amax 0 or an fp32 subnormal has ``E = 0`` and gives scale byte 0 (2^-127).
    - amax = ±inf has ``E = 255`` and gives byte ``255 - emax`` (247 for E4M3, 240 for E5M2): an
      ordinary scale, not NaN. The inf elements then saturate to ±max, the others scale normally.
    - The smallest exponent is clamped to -127 (byte 0); the largest byte from a finite amax is
      246 / 239, so the upper clamp never binds.
    - NaN amax gives byte 0xFF.
    - Elements: ``x / s`` in float32, clamped to ±max (saturation: with amax mantissa >= 1.75 the
      largest element of an E4M3 block lands in (448, 512)), then cast to FP8 round-to-nearest-even.
      ``s`` is the float32 power of two of the byte, except that byte 0 divides by 2^-126, not
      2^-127 (torchao keeps scales normal), so such tiny blocks dequantize to half their value.
      Byte 0xFF divides by +inf: finite elements become ±0, NaN stays NaN (its sign kept), inf
      becomes the processor's default NaN (negative on x86, so E4M3 byte 0xFF).

``rceil`` (NVIDIA: scale = amax / max_elem rounded up to a power of two)
    - ``d = amax / max_elem`` in float32 (correctly rounded, so ``d`` itself may round).
    - Byte: 0xFF for NaN amax, 254 (2^127) for inf amax, else ``clamp(ceil(log2(d)), -127, 127)
      + 127``; amax 0 gives -inf, so byte 0.
    - ``ceil(log2(d))`` is evaluated as torchao does, in float32 with ``torch.log2``. That is *not*
      an exact round-up: for ``d`` a few ulps above a power of two 2^e the float32 ``log2(d)``
      rounds to exactly ``e`` once ``|e| >= 4`` (e.g. up to 23 mantissa ulps at e = 100), so
      ``d`` is rounded down to 2^e and the block's largest element saturates to max. Integer bit
      operations alone cannot reproduce this; the native kernel uses a table of the largest such
      mantissa per exponent, measured from ``torch.log2`` when it loads (``mx_native``).
    - Elements: ``x * r`` in float32 with ``r = 2^(127 - byte)``, except byte 0 multiplies by 1
      (not 2^127), byte 254 by 2^-127, byte 0xFF by the NaN ``d`` (every element of a NaN block
      becomes +NaN, E4M3 byte 0x7F, whatever its own sign); then clamped to ±max and cast.

``dequantize`` multiplies each element by 2^(byte - 127) (NaN for 0xFF), as torchao's
``to_dtype`` does.

``quantize(..., backend="auto")`` uses the native CPU (or CUDA) kernel from ``csrc/`` when it
builds and loads (``mfsdp_core.mx_native``), else this reference with a one-line notice, once per
process. Both give the same bytes.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mfsdp_core import mx_native  # importing it builds nothing: the kernel is built on first use
from mfsdp_core.mx_names import AXES, BACKENDS, BLOCK, ELEMENTS, RULES

__all__ = [
    "BLOCK",
    "MXFormat",
    "quantize",
    "quantize_reference",
    "dequantize",
    "MXNativeUnavailableWarning",
    "ELEMENTS",
    "RULES",
    "AXES",
    "BACKENDS",
]


# element -> (torch dtype, max finite value, exponent of the largest power of two <= max)
_ELEM = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 8),
    "e5m2": (torch.float8_e5m2, 57344.0, 15),
}
_E8M0_BIAS = 127
_E8M0_NAN = 255
_F32_MIN_NORMAL = 2.0**-126


class MXNativeUnavailableWarning(RuntimeWarning):
    """``quantize(backend="auto")`` fell back to the reference: the native kernel did not load."""


@dataclass(frozen=True)
class MXFormat:
    """An MXFP8 format: element type (``"e4m3"`` | ``"e5m2"``) and scale rule (``"floor"`` | ``"rceil"``)."""

    element: str = "e4m3"
    rule: str = "floor"

    def __post_init__(self) -> None:
        if self.element not in _ELEM:
            raise ValueError(f"MXFormat: unknown element {self.element!r} (expected one of {', '.join(ELEMENTS)})")
        if self.rule not in RULES:
            raise ValueError(f"MXFormat: unknown rule {self.rule!r} (expected one of {', '.join(RULES)})")

    @property
    def dtype(self) -> torch.dtype:
        """The element dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
        return _ELEM[self.element][0]

    @property
    def max(self) -> float:
        """Largest finite element value (448 or 57344)."""
        return _ELEM[self.element][1]

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two an element holds (8 or 15)."""
        return _ELEM[self.element][2]

    def to_dict(self) -> dict[str, str]:
        """Plain dict for manifests and configs; ``from_dict`` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MXFormat:
        """Inverse of ``to_dict`` (missing keys take the defaults; unknown keys are refused)."""
        extra = set(d) - {"element", "rule"}
        if extra:
            raise ValueError(f"MXFormat.from_dict: unknown keys {sorted(extra)}")
        return cls(**d)

    def __str__(self) -> str:
        return f"mxfp8 {self.element} {self.rule}"


def _check(x: torch.Tensor, fmt: MXFormat, axis: str) -> None:
    if not isinstance(fmt, MXFormat):
        raise TypeError(f"mx.quantize: fmt must be an MXFormat, got {type(fmt).__name__}")
    if axis not in AXES:
        raise ValueError(f"mx.quantize: axis must be 'row' or 'col', got {axis!r}")
    if x.dim() != 2:
        raise ValueError(f"mx.quantize: expected a 2-D tensor, got shape {tuple(x.shape)} (axis {axis!r})")
    if x.dtype != torch.float32:
        raise ValueError(f"mx.quantize: expected float32 input, got {x.dtype} (shape {tuple(x.shape)}, axis {axis!r})")
    dim = 1 if axis == "row" else 0
    if x.shape[dim] % BLOCK:
        name = "K" if dim == 1 else "M"
        raise ValueError(
            f"mx.quantize: shape {tuple(x.shape)} with axis {axis!r} needs {name} = {x.shape[dim]} "
            f"to be a multiple of {BLOCK}"
        )


def _rowwise(x: torch.Tensor, fmt: MXFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along the last dim of a contiguous float32 [N, K]: (uint8 data bits, uint8 scale bytes)."""
    n, k = x.shape
    blocks = x.reshape(n, k // BLOCK, BLOCK)
    amax = torch.amax(torch.abs(blocks), dim=-1, keepdim=True)  # NaN if the block has a NaN
    is_nan = torch.isnan(amax)
    if fmt.rule == "floor":
        exp_field = torch.bitwise_right_shift(amax.view(torch.int32), 23) & 0xFF
        biased = torch.clamp(exp_field - fmt.emax, min=0, max=254)
        biased = torch.where(is_nan, _E8M0_NAN, biased)
        scale_f32 = torch.bitwise_left_shift(biased, 23).view(torch.float32)  # 0xFF -> +inf
        scale_f32 = torch.clamp(scale_f32, min=_F32_MIN_NORMAL)  # byte 0 divides by 2^-126
        scaled = blocks / scale_f32
    else:
        descale = amax / fmt.max
        up = torch.clamp(torch.ceil(torch.log2(descale)), min=-_E8M0_BIAS, max=_E8M0_BIAS) + _E8M0_BIAS
        biased = torch.where(is_nan, _E8M0_NAN, torch.where(torch.isinf(descale), 254, up.to(torch.int32)))
        recip = torch.exp2(_E8M0_BIAS - biased.to(torch.float32))
        recip = torch.where(biased == 0, 1.0, recip)
        recip = torch.where(biased == 254, 2.0**-127, recip)
        recip = torch.where(is_nan, descale, recip)  # the NaN itself: every element becomes +NaN
        scaled = blocks * recip
    data = torch.clamp(scaled, min=-fmt.max, max=fmt.max).to(fmt.dtype)  # clamp keeps NaN
    return data.reshape(n, k), biased.reshape(n, k // BLOCK).to(torch.uint8)


def quantize_reference(x: torch.Tensor, fmt: MXFormat, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch MXFP8 quantize of a float32 [M, K] (see the module docstring for the rules).

    Returns ``(data, scale)``: data [M, K] in ``fmt.dtype`` (same orientation as ``x`` for both
    axes), scale ``[M, K/32]`` (row) or ``[M/32, K]`` (col) in ``torch.float8_e8m0fnu``."""
    _check(x, fmt, axis)
    if axis == "row":
        data, scale = _rowwise(x.contiguous(), fmt)
    else:
        data_t, scale_t = _rowwise(x.t().contiguous(), fmt)
        data, scale = data_t.t().contiguous(), scale_t.t().contiguous()
    return data, scale.view(torch.float8_e8m0fnu)


_notice_given = False


def _fallback_notice(reason: str) -> None:
    global _notice_given
    if not _notice_given:
        _notice_given = True
        warnings.warn(
            f"mfsdp_core.mx: native MXFP8 cast unavailable ({reason}); using the PyTorch reference",
            MXNativeUnavailableWarning,
            stacklevel=3,
        )


def quantize(x: torch.Tensor, fmt: MXFormat, axis: str, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantize of a float32 [M, K]; same result as ``quantize_reference``.

    ``backend``: ``"auto"`` uses the native kernel for ``x``'s device when it loads, else the
    reference (warning ``MXNativeUnavailableWarning`` once per process with the reason);
    ``"reference"`` / ``"native"`` force one (``"native"`` raises RuntimeError if it cannot load)."""
    if backend not in BACKENDS:
        raise ValueError(f"mx.quantize: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _check(x, fmt, axis)
    if backend == "reference":
        return quantize_reference(x, fmt, axis)
    kernel = mx_native.load(x.device.type)
    if kernel is None:
        reason = mx_native.unavailable_reason(x.device.type) or "not loaded"
        if backend == "native":
            raise RuntimeError(f"mx.quantize: native MXFP8 cast unavailable: {reason}")
        _fallback_notice(reason)
        return quantize_reference(x, fmt, axis)
    return mx_native.quantize(kernel, x, fmt.element, fmt.rule, axis, fmt.dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: str) -> torch.Tensor:
    """Float32 [M, K] from MXFP8 ``data`` [M, K] and its E8M0 ``scale`` plane (any 1-byte dtype).

    Each element is multiplied by 2^(byte - 127); a 0xFF byte makes its whole block NaN."""
    if axis not in AXES:
        raise ValueError(f"mx.dequantize: axis must be 'row' or 'col', got {axis!r}")
    if data.dim() != 2 or scale.dim() != 2 or scale.element_size() != 1:
        raise ValueError(
            f"mx.dequantize: expected 2-D data and a 2-D 1-byte scale, got {tuple(data.shape)} {data.dtype} "
            f"and {tuple(scale.shape)} {scale.dtype} (axis {axis!r})"
        )
    m, k = data.shape
    want = (m, k // BLOCK) if axis == "row" else (m // BLOCK, k)
    dim = 1 if axis == "row" else 0
    if data.shape[dim] % BLOCK or tuple(scale.shape) != want:
        raise ValueError(
            f"mx.dequantize: data {tuple(data.shape)} with axis {axis!r} needs a scale plane of shape "
            f"{want} and a blocked dim divisible by {BLOCK}, got scale {tuple(scale.shape)}"
        )
    byte = scale.view(torch.uint8).to(torch.int32)
    factor = torch.exp2((byte - _E8M0_BIAS).to(torch.float32))
    factor = torch.where(byte == _E8M0_NAN, float("nan"), factor)
    factor = factor.repeat_interleave(BLOCK, dim=dim)
    return data.to(torch.float32) * factor
