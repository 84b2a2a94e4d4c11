"""Token files as a run records them (path, dtype, token count), torch-free: the launcher's
pre-flight compares a resumed run's data source with the one its checkpoint records without
importing torch; :class:`mfsdp_core.data.TokenFile` reads the samples."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["TOKEN_DTYPES", "describe_token_file", "token_windows"]

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def describe_token_file(path: str, dtype: str) -> str:
    """``/abs/path (uint16, N tokens)``: a token file as a run records its data source, so a resumed
    run that reads another file, or the same one grown or read with another dtype, is told."""
    try:
        tokens = str(os.path.getsize(path) // np.dtype(TOKEN_DTYPES[dtype]).itemsize)
    except (OSError, KeyError):
        tokens = "?"
    return f"{os.path.abspath(path)} ({dtype}, {tokens} tokens)"


def token_windows(path: str, seq_len: int, dtype: str) -> tuple[int, int]:
    """``(tokens, windows)`` of the token file ``path`` read as ``dtype``: its token count and the
    number of samples of ``seq_len + 1`` tokens it holds (see :class:`mfsdp_core.data.TokenFile`);
    a one-line ValueError naming ``--data`` / ``--data-dtype`` for a file that cannot be one."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--data-dtype {dtype!r}: one of {', '.join(TOKEN_DTYPES)}")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ValueError(f"--data {path}: {e.strerror or e}") from None
    if os.path.isdir(path):
        raise ValueError(f"--data {path}: is a directory, not a token file")
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ValueError(
            f"--data {path}: {size} bytes is not a whole number of {dtype} token ids "
            f"({itemsize} bytes each); is --data-dtype right?"
        )
    tokens = size // itemsize
    windows = (tokens - 1) // seq_len if tokens else 0
    if windows < 1:
        raise ValueError(f"--data {path}: {tokens} tokens, fewer than one sample of --seq-len {seq_len} + 1")
    return tokens, windows
