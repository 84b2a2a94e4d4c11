"""The choices an MXFP8 format is made of (block size, element type, scale rounding rule, scaling
axis, kernel backend). Torch-free, so that a manifest's schema checks a recorded format without
importing torch; :mod:`mfsdp_core.mx` quantizes with them."""

from __future__ import annotations

__all__ = ["BLOCK", "ELEMENTS", "RULES", "AXES", "BACKENDS"]

BLOCK = 32
ELEMENTS = ("e4m3", "e5m2")
RULES = ("floor", "rceil")
AXES = ("row", "col")
BACKENDS = ("auto", "reference", "native")
