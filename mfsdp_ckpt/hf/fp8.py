"""Block-scaled FP8 weights in a Hugging Face directory (DeepSeek-V3's format, also used by the
``-FP8`` releases of Qwen3): reading ``quantization_config``, checking the weights and their scales
against it and the files, and dequantizing one weight at a time.

The format (transformers' ``FineGrainedFP8Config``, ``quant_method: "fp8"``): each quantized
linear weight ``<module>.weight`` ``[out, in]`` is stored as F8_E4M3 next to
``<module>.weight_scale_inv`` of shape ``[ceil(out / bo), ceil(in / bi)]`` (F32, sometimes BF16),
``[bo, bi]`` being ``weight_block_size``; its real value is ``fp8.float() * scale_inv[r // bo,
c // bi]`` element by element (the blocks at the right and bottom edges are partial). Every other
tensor is stored unquantized. Which weights are quantized is what the files say (their dtype), not
``modules_to_not_convert``, which only lists some of the others.

Dequantizing is done in float32, exactly that product, and cast once to the dtype the import
writes; a weight is processed in bands of rows of bounded size, so that memory holds the weight's
FP8 bytes, its output and one band, never a float32 copy of the whole weight.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.files import HFTensor, hf_safetensors_name, short_repr
from mfsdp_ckpt.hf.workers import Staging

__all__ = [
    "QUANT_METHOD",
    "SCALE_SUFFIX",
    "BlockFP8",
    "FP8Layout",
    "is_fp8",
    "is_fp8_config",
    "scale_name",
    "parse_fp8_config",
    "fp8_layout",
    "default_dtype",
    "dequantize_blocks",
]

#: transformers' name for fine-grained (block-scaled) FP8 (``QuantizationMethod.FP8``)
QUANT_METHOD = "fp8"
#: the scale tensor next to ``<module>.weight``: the factor the FP8 data is multiplied by
SCALE_SUFFIX = "weight_scale_inv"
#: ``quantization_config.fmt`` -> the element dtype of the weights (DeepSeek writes ``"e4m3"``;
#: transformers records no ``fmt`` and reads E4M3)
ELEMENTS = {"e4m3": torch.float8_e4m3fn}
#: the dtypes block scales may be stored in
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: transformers' default ``weight_block_size``
DEFAULT_BLOCK = (128, 128)
#: the largest block side accepted (the bound other widths of ``config.json`` have)
MAX_BLOCK = 2**24
#: float32 bytes of one band of rows dequantized at a time
BAND_BYTES = 16 * 2**20

_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FP8_DTYPES = frozenset(getattr(torch, n) for n in _FP8_NAMES if isinstance(getattr(torch, n, None), torch.dtype))
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an FP8 element dtype (E4M3 / E5M2, either flavour): weights in one are
    quantized and cannot be imported without their scales."""
    return dtype in _FP8_DTYPES


def is_fp8_config(qc: Any) -> bool:
    """Whether ``quantization_config`` names this format (``quant_method: "fp8"``)."""
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


@dataclass(frozen=True)
class BlockFP8:
    """What ``quantization_config`` says of a block-scaled FP8 directory: the element format and
    the block ``[rows, columns]`` each scale covers."""

    fmt: str = "e4m3"
    block: tuple[int, int] = DEFAULT_BLOCK

    @property
    def dtype(self) -> torch.dtype:
        return ELEMENTS[self.fmt]

    def scale_shape(self, shape: torch.Size) -> torch.Size:
        """``[ceil(out / bo), ceil(in / bi)]``: one scale per block of an ``[out, in]`` weight."""
        return torch.Size(-(-int(n) // b) for n, b in zip(shape, self.block))

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "fmt": self.fmt, "weight_block_size": list(self.block)}


def _block_size(value: Any, where: str) -> tuple[int, int]:
    """``weight_block_size``: two JSON integers in [1, :data:`MAX_BLOCK`] (``true``, ``128.0`` and
    ``"128"`` are refused, as every count of ``config.json`` is)."""
    if value is None:
        raise ConversionError(
            f"{where}.weight_block_size is null (per-tensor scales), not supported: expected [rows, columns]"
        )
    ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and 1 <= v <= MAX_BLOCK for v in value)
    if not ok:
        raise ConversionError(
            f"{where}.weight_block_size {short_repr(value)}: expected [rows, columns], two integers in [1, {MAX_BLOCK}]"
        )
    return value[0], value[1]


def _check_option(qc: Mapping[str, Any], key: str, allowed: tuple[Any, ...], where: str, why: str) -> None:
    """Refuse ``qc[key]`` (absent: ``allowed[0]``; strings compared in lower case, as transformers
    does) unless it is one of ``allowed``, saying ``why``."""
    value = qc.get(key, allowed[0])
    if isinstance(value, str):
        value = value.lower()
    if value not in allowed:
        raise ConversionError(f"{where}.{key} {short_repr(value)} is not supported ({why})")


def parse_fp8_config(qc: Any, config_path: str) -> BlockFP8:
    """The format a ``quant_method: "fp8"`` ``quantization_config`` states, checked; one
    ConversionError line naming ``config.json`` and the field otherwise: an ``fmt`` other than
    ``e4m3`` (absent: E4M3, as transformers assumes), a ``weight_block_size`` that is not two
    integers in [1, 2²⁴] (absent: transformers' ``[128, 128]``), static activations (``input_scale``
    tensors), FP4 experts, an unknown ``scale_fmt``, a ``modules_to_not_convert`` that is not a
    list of names. Other fields (``dequantize``, ``modules_to_convert``) do not change the weights."""
    where = f"{config_path}: quantization_config"
    if not is_fp8_config(qc):
        raise ConversionError(f"{where}: not a quant_method {QUANT_METHOD!r} config")
    fmt = qc.get("fmt", "e4m3")
    if not isinstance(fmt, str) or fmt not in ELEMENTS:
        raise ConversionError(
            f"{where}.fmt {short_repr(fmt)} is not supported (block-scaled FP8 weights: {', '.join(map(repr, ELEMENTS))})"
        )
    block = _block_size(qc.get("weight_block_size", list(DEFAULT_BLOCK)), where)
    _check_option(qc, "activation_scheme", ("dynamic",), where, "only 'dynamic': no input scales")
    _check_option(qc, "expert_dtype", ("fp8",), where, "only 'fp8' experts")
    _check_option(qc, "scale_fmt", ("float", "ue8m0", None), where, "expected 'float' or 'ue8m0'")
    skip = qc.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise ConversionError(f"{where}.modules_to_not_convert must be a list of module names, got {short_repr(skip)}")
    return BlockFP8(fmt, block)


@dataclass
class FP8Layout:
    """The block-scaled FP8 weights of a directory, checked: the format (None: the directory is not
    in this format), each quantized HF weight with the name of its scale tensor, and the shape
    each scale tensor must have."""

    fmt: BlockFP8 | None = None
    scales: dict[str, str] = field(default_factory=dict)
    scale_shapes: dict[str, torch.Size] = field(default_factory=dict)


def scale_name(hf_weight: str) -> str:
    """``<module>.weight_scale_inv`` for ``<module>.weight``."""
    return f"{hf_weight[: -len('.weight')]}.{SCALE_SUFFIX}"


def fp8_layout(
    path: str, tensors: Mapping[str, HFTensor], planned: Mapping[str, torch.Size], fmt: BlockFP8, config_path: str
) -> FP8Layout:
    """Check every FP8 tensor among the HF tensors of the mapping (``planned``) of the directory at
    ``path``, before any data is read: it is in the element dtype ``fmt`` names, a matrix called
    ``<module>.weight``, with a ``<module>.weight_scale_inv`` in F32 / BF16 / F16 of shape
    ``[ceil(out / bo), ceil(in / bi)]``. Each refusal is one line naming the file and the tensor
    (E8M0 scales, transformers' ``scale_fmt "ue8m0"`` storage, also name ``config.json``)."""
    out = FP8Layout(fmt)
    for key in sorted(k for k in planned if k in tensors and is_fp8(tensors[k].dtype)):
        weight = tensors[key]
        where = os.path.join(path, weight.file)
        if weight.dtype != fmt.dtype:
            raise ConversionError(
                f"{where}: tensor {key!r} is {hf_safetensors_name(weight.dtype)}; quantization_config.fmt is "
                f"{fmt.fmt!r} ({hf_safetensors_name(fmt.dtype)})"
            )
        if len(weight.shape) != 2 or not key.endswith(".weight"):
            raise ConversionError(
                f"{where}: tensor {key!r} {tuple(weight.shape)} is FP8 but not a '<module>.weight' matrix "
                "(block scales cover [out, in] weights)"
            )
        name = scale_name(key)
        scale = tensors.get(name)
        if scale is None:
            raise ConversionError(f"{where}: FP8 tensor {key!r} has no {name!r} (its block scales)")
        _check_scale(os.path.join(path, scale.file), name, scale, key, weight.shape, fmt, config_path)
        out.scales[key] = name
        out.scale_shapes[name] = fmt.scale_shape(weight.shape)
    return out


def _check_scale(
    where: str, name: str, scale: HFTensor, key: str, shape: torch.Size, fmt: BlockFP8, config_path: str
) -> None:
    """One scale tensor against its weight's shape and the block size."""
    if _E8M0 is not None and scale.dtype == _E8M0:
        raise ConversionError(
            f"{config_path}: quantization_config.quant_method {QUANT_METHOD!r} is not supported with E8M0 scales "
            f"({where}: tensor {name!r} is F8_E8M0; block scales are read in F32, BF16 or F16; "
            "E8M0 scales in [1, 32] blocks are the 'mxfp8' format)"
        )
    if scale.dtype not in SCALE_DTYPES:
        raise ConversionError(
            f"{where}: tensor {name!r} is {hf_safetensors_name(scale.dtype)}, expected F32, BF16 or F16 (block scales)"
        )
    want = fmt.scale_shape(shape)
    if scale.shape != want:
        raise ConversionError(
            f"{where}: tensor {name!r} has shape {tuple(scale.shape)}, expected {tuple(want)} (one scale per "
            f"{list(fmt.block)} block of {key!r} {tuple(shape)}, edge blocks partial)"
        )


def default_dtype(tensors: Mapping[str, HFTensor], planned: Mapping[str, torch.Size], quantized: Any) -> torch.dtype:
    """The dtype FP8 weights are dequantized into when the import is given none: that of most of
    the unquantized tensors' bytes (the embeddings and the head dominate: bfloat16 for DeepSeek-V3
    and Qwen3-FP8), if it is bfloat16 or float32; float32 otherwise (float16 could overflow)."""
    nbytes: Counter[torch.dtype] = Counter()
    for key in planned:
        t = tensors.get(key)
        if t is not None and key not in quantized:
            nbytes[t.dtype] += t.shape.numel() * t.dtype.itemsize
    if not nbytes:
        return torch.float32
    best = max(nbytes, key=lambda d: (nbytes[d], d.itemsize))  # a tie goes to the wider dtype
    return best if best in (torch.bfloat16, torch.float32) else torch.float32


def _scale_rows(w: torch.Tensor, s: torch.Tensor, r0: int, bo: int) -> None:
    """Multiply the band ``w`` (rows ``r0 ..`` of a weight, float32) in place by its scales: row
    ``r0 + i`` by ``s[(r0 + i) // bo - r0 // bo]`` (``s``: the band's block rows, expanded to
    columns). A partial block at either end of the band, whole blocks in one broadcast."""
    n, i, b = w.shape[0], 0, 0
    head = min(n, (-r0) % bo)
    if head:
        w[:head].mul_(s[0])
        i, b = head, 1
    full = (n - i) // bo
    if full:
        w[i : i + full * bo].view(full, bo, w.shape[1]).mul_(s[b : b + full].unsqueeze(1))
        i, b = i + full * bo, b + full
    if i < n:
        w[i:].mul_(s[b])


def dequantize_blocks(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor,
    scratch: Staging | None = None,
) -> torch.Tensor:
    """Fill ``out`` (contiguous, ``data``'s shape, any floating dtype) with
    ``float32(data[r, c]) * float32(scale_inv[r // bo, c // bi])`` cast to ``out.dtype``: the
    product rounded once in float32, then once to ``out``'s dtype, bitwise what the formula
    gives. Done in bands of rows of about :data:`BAND_BYTES` of float32 (in ``out`` itself when
    it is float32, else in a band of ``scratch``, a worker's reused buffer), so that no float32
    copy of the whole weight is made. Returns ``out``."""
    rows, cols = data.shape
    bo, bi = block
    step = max(1, BAND_BYTES // max(1, cols * 4))
    direct = out.dtype == torch.float32
    band = None if direct else (scratch or Staging()).tensor(torch.float32, (min(rows, step) * cols,))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = out[r0:r1] if band is None else band[: (r1 - r0) * cols].view(r1 - r0, cols)
        w.copy_(data[r0:r1])
        s = scale_inv[r0 // bo : (r1 - 1) // bo + 1].to(torch.float32).repeat_interleave(bi, dim=1)[:, :cols]
        _scale_rows(w, s, r0, bo)
        if not direct:
            out[r0:r1].copy_(w)
    return out
