"""MXFP8 weights in the runtime: an MX parameter's four planes are companions of it in the
placement plan, and its compute weights are dequantized from them.

An MX parameter ``[M, K]`` (both multiples of 32) keeps fp32 main params, sharded on whole 32-row
blocks (``block(32)``), so that each rank quantizes only the blocks it owns, in both orientations,
with no amax communication: a 32-row block holds every rowwise (1×32) block of its rows and every
columnwise (32×1) block of its columns. The planes, each laid out from the parameter's rows:

==================  ===========  ==================  =====================
plane               shape        dtype               used for
==================  ===========  ==================  =====================
``rowwise_data``    ``[M, K]``   E4M3 / E5M2         forward (``x @ Wᵀ``)
``rowwise_scale``   ``[M, K/32]``  E8M0              forward
``columnwise_data`` ``[M, K]``   E4M3 / E5M2         backward (``dy @ W``)
``columnwise_scale`` ``[M/32, K]`` E8M0              backward
==================  ===========  ==================  =====================

The all-gather of an MX buffer moves these planes (as bytes), never the weights: the rowwise ones
before forward, the columnwise ones before backward; the compute weights are then dequantized from
them locally (on CPU; Transformer Engine would consume the planes directly).
"""

from __future__ import annotations

from typing import Callable

import torch

from mfsdp_core.companion import Companion
from mfsdp_core.mx import MXFormat, quantize

__all__ = ["MX_PLANES", "ORIENTATIONS", "mx_companions"]

# the (data, scale) planes of each orientation: "row" for forward, "col" for backward
ORIENTATIONS = {"row": ("rowwise_data", "rowwise_scale"), "col": ("columnwise_data", "columnwise_scale")}
MX_PLANES = (*ORIENTATIONS["row"], *ORIENTATIONS["col"])


def _quantizer(fmt: MXFormat, axis: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``quantize(rows, fmt, axis)`` remembering its last result, so that the data plane and the
    scale plane of one orientation come from one quantization (the runtime derives each companion
    separately, one right after the other, from the same main-param rows)."""
    last: list = [None, None]

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows.data_ptr(), tuple(rows.shape), rows.stride(), rows._version)
        if last[0] != key:
            last[0], last[1] = key, quantize(rows, fmt, axis)
        return last[1]

    return run


def mx_companions(fmt: MXFormat) -> tuple[Companion, ...]:
    """The four MX planes of a parameter in format ``fmt``, each derived from the fp32 main rows a
    rank owns (whole 32-row blocks)."""
    row, col = _quantizer(fmt, "row"), _quantizer(fmt, "col")
    e8m0 = torch.float8_e8m0fnu
    return (
        Companion("rowwise_data", fmt.dtype, 1, 1, derive=lambda rows: row(rows)[0]),
        Companion("rowwise_scale", e8m0, 1, 32, derive=lambda rows: row(rows)[1]),
        Companion("columnwise_data", fmt.dtype, 1, 1, derive=lambda rows: col(rows)[0]),
        Companion("columnwise_scale", e8m0, 32, 1, derive=lambda rows: col(rows)[1]),
    )
