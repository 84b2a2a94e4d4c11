"""The names of the dtypes the runtime and the checkpoint layer handle, with their other spellings
(see :mod:`mfsdp_core.dtypes`, which pairs each row with its ``torch.dtype``). Torch-free, so that a
manifest's schema checks a dtype name without importing torch."""

from __future__ import annotations

__all__ = ["DTYPE_ROWS", "DTYPE_NAMES", "check_dtype_name"]

# name, safetensors, legacy storage class, travels as uint8
DTYPE_ROWS: tuple[tuple[str, str | None, str | None, bool], ...] = (
    ("float32", "F32", "FloatStorage", False),
    ("bfloat16", "BF16", "BFloat16Storage", False),
    ("float16", "F16", "HalfStorage", False),
    ("float64", "F64", "DoubleStorage", False),
    ("int64", "I64", "LongStorage", False),
    ("int32", "I32", "IntStorage", False),
    ("int16", "I16", "ShortStorage", False),
    ("int8", "I8", "CharStorage", False),
    ("uint8", "U8", "ByteStorage", False),
    ("bool", "BOOL", "BoolStorage", False),
    ("float8_e4m3fn", "F8_E4M3", None, True),
    ("float8_e5m2", "F8_E5M2", None, True),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ", None, True),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ", None, True),
    ("float8_e8m0fnu", None, None, True),
)

DTYPE_NAMES: tuple[str, ...] = tuple(row[0] for row in DTYPE_ROWS)


def check_dtype_name(name: str) -> str:
    """``name`` when it names a dtype of the table (``"bfloat16"``); a one-line ValueError naming
    the valid names otherwise. (:func:`mfsdp_core.dtypes.dtype_by_name` also needs the installed
    torch to have it.)"""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return name
