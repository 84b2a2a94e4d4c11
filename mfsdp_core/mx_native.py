"""Loader of the native MXFP8 cast kernels (csrc/). Placeholder: no kernel is built yet."""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["load", "unavailable_reason", "quantize"]


def load(device: str = "cpu") -> ModuleType | None:
    """The compiled kernel module for ``device``, or None (see ``unavailable_reason``)."""
    return None


def unavailable_reason(device: str = "cpu") -> str | None:
    """Why ``load(device)`` returned None, in one line."""
    return "not built yet"


def quantize(kernel: ModuleType, x: torch.Tensor, fmt, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError
