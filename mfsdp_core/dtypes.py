"""TEMPORARY stub (replaced by the dtype table from branch io-vocab)."""
from __future__ import annotations
import torch

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

def dtype_by_name(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d
