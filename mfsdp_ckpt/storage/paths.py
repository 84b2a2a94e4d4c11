"""What kind of place a path names: a local path or an fsspec URL. The one definition; the
rest of the checkpoint package asks :mod:`mfsdp_ckpt.storage.fs`, which hides the difference."""

from __future__ import annotations

import os

__all__ = ["is_url"]


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL other than ``file://``."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")
