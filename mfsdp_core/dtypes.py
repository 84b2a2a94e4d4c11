"""The dtypes the runtime and the checkpoint layer handle, in one table.

Each dtype has one name (torch's own attribute name: ``"float32"``, ``"bfloat16"``, …), used in
configs, manifests and on the command line, and three spellings elsewhere:

- its **safetensors** header string (``"F32"``, ``"F8_E4M3"``); None where the installed
  safetensors cannot round-trip it through ``safetensors.torch.save`` / ``load``. (safetensors
  0.8 writes ``F8_E8M0`` and ``safe_open`` reads it, but ``safetensors.torch.load`` does not know
  the name, so e8m0 is not listed.)
- its **legacy storage class** as ``torch.save`` pickles it into a record's ``data.pkl``
  (``FloatStorage``); None for the dtypes torch saves as an ``UntypedStorage`` followed by the
  dtype itself (``_rebuild_tensor_v3``: fp8 and e8m0). ``mfsdp_ckpt.read.records`` recognises a plain
  record by this name, and declines the others, which then go through ``torch.load``.
- its **wire** dtype for collectives: gloo has no fp8 collectives, so fp8 and e8m0 travel as
  ``uint8`` views of the same bytes.

The fp8 / e8m0 rows are listed only when the installed torch has the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mfsdp_core.dtype_names import DTYPE_ROWS

__all__ = [
    "DtypeInfo",
    "DTYPES",
    "CAST_CHOICES",
    "dtype_by_name",
    "dtype_name",
    "safetensors_name",
    "dtype_from_safetensors",
    "storage_name",
    "wire_dtype",
    "wire_view",
]


@dataclass(frozen=True)
class DtypeInfo:
    """One row of the table (see the module docstring for what each spelling is for)."""

    name: str
    dtype: torch.dtype
    safetensors: str | None
    storage: str | None
    wire: torch.dtype


DTYPES: tuple[DtypeInfo, ...] = tuple(
    DtypeInfo(name, getattr(torch, name), st, storage, torch.uint8 if as_bytes else getattr(torch, name))
    for name, st, storage, as_bytes in DTYPE_ROWS
    if isinstance(getattr(torch, name, None), torch.dtype)
)

# what ``reshard --dtype`` and ``export-hf --dtype`` may cast weights to
CAST_CHOICES: tuple[str, ...] = ("float32", "bfloat16", "float16")

_BY_NAME = {d.name: d for d in DTYPES}
_BY_DTYPE = {d.dtype: d for d in DTYPES}
_BY_SAFETENSORS = {d.safetensors: d for d in DTYPES if d.safetensors is not None}


def dtype_by_name(name: str) -> torch.dtype:
    """The dtype called ``name`` (``"bfloat16"``); a one-line ValueError naming the valid names
    otherwise."""
    info = _BY_NAME.get(name)
    if info is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_BY_NAME)}")
    return info.dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``); a ValueError for a dtype the
    table does not list."""
    info = _BY_DTYPE.get(dtype)
    if info is None:
        raise ValueError(f"dtype {dtype} is not handled; expected one of {', '.join(_BY_NAME)}")
    return info.name


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors header string for ``dtype`` (``"BF16"``); None if safetensors cannot
    store it."""
    info = _BY_DTYPE.get(dtype)
    return info.safetensors if info is not None else None


def dtype_from_safetensors(name: str) -> torch.dtype | None:
    """The dtype a safetensors header string stands for; None for one we do not read."""
    info = _BY_SAFETENSORS.get(name)
    return info.dtype if info is not None else None


def storage_name(dtype: torch.dtype) -> str | None:
    """The legacy storage class ``torch.save`` pickles for a tensor of ``dtype``
    (``"FloatStorage"``); None where it pickles an ``UntypedStorage`` and the dtype instead."""
    info = _BY_DTYPE.get(dtype)
    return info.storage if info is not None else None


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as in collectives (itself, or ``uint8``)."""
    info = _BY_DTYPE.get(dtype)
    return info.wire if info is not None else dtype


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as collectives move it: a ``uint8`` view of the same bytes for fp8 / e8m0
    (gloo has no fp8 collectives), the tensor itself otherwise."""
    wire = wire_dtype(tensor.dtype)
    return tensor if wire == tensor.dtype else tensor.view(wire)
