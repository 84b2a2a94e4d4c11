"""Compare two checkpoints logically, whatever layouts wrote them.

Each tensor is read whole (DCP assembles it from whichever chunks hold it) one key at a time, so
memory stays bounded by the largest tensor of the two checkpoints, not by their size.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .inspect import open_checkpoint
from .planner import MfsdpLoadPlanner

__all__ = ["TensorDiff", "CheckpointDiff", "diff_checkpoints"]


@dataclass(frozen=True)
class TensorDiff:
    key: str
    problem: str  # "shape", "dtype", "values" or "object"
    detail: str
    max_abs: float | None = None


@dataclass
class CheckpointDiff:
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    different: list[TensorDiff] = field(default_factory=list)
    compared: int = 0

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.different)

    def to_json(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "compared": self.compared,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "different": [d.__dict__ for d in self.different],
        }


def read_entry(reader_dir: str, manifest: dict | None, key: str, md: Any) -> Any:
    """One whole entry (tensor or object) of a checkpoint, verified, in one process."""
    from .storage import VerifyingReader

    reader = VerifyingReader(reader_dir, manifest)
    planner = MfsdpLoadPlanner()
    target: dict[str, Any] = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)} if isinstance(md, TensorStorageMetadata) else {key: None}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
    reader.apply(planner)
    return target[key] if target[key] is not None else planner.objects[key]


def diff_checkpoints(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
                     ignore: tuple[str, ...] = ("extra.rng.",)) -> CheckpointDiff:
    """Keys only in one checkpoint, shape / dtype changes, and tensors whose values differ by more
    than ``atol + rtol * |b|`` anywhere (reporting max |a - b|; NaNs in the same places are equal). Keys starting with a prefix in
    ``ignore`` are skipped (by default the per-rank RNG states, which depend on the world size)."""
    dir_a, man_a, meta_a, _ = open_checkpoint(os.fspath(a))
    dir_b, man_b, meta_b, _ = open_checkpoint(os.fspath(b))
    keys_a = {k for k in meta_a.state_dict_metadata if not k.startswith(ignore)}
    keys_b = {k for k in meta_b.state_dict_metadata if not k.startswith(ignore)}
    out = CheckpointDiff(only_in_a=sorted(keys_a - keys_b), only_in_b=sorted(keys_b - keys_a))
    for key in sorted(keys_a & keys_b):
        md_a, md_b = meta_a.state_dict_metadata[key], meta_b.state_dict_metadata[key]
        tensor_a, tensor_b = isinstance(md_a, TensorStorageMetadata), isinstance(md_b, TensorStorageMetadata)
        out.compared += 1
        if tensor_a != tensor_b:
            out.different.append(TensorDiff(key, "object", "a tensor in one checkpoint, an object in the other"))
            continue
        if tensor_a and tuple(md_a.size) != tuple(md_b.size):
            out.different.append(TensorDiff(key, "shape", f"{tuple(md_a.size)} vs {tuple(md_b.size)}"))
            continue
        if tensor_a and md_a.properties.dtype != md_b.properties.dtype:
            out.different.append(TensorDiff(key, "dtype", f"{md_a.properties.dtype} vs {md_b.properties.dtype}"))
            continue
        va, vb = read_entry(dir_a, man_a, key, md_a), read_entry(dir_b, man_b, key, md_b)
        if not tensor_a:
            if va != vb:
                out.different.append(TensorDiff(key, "object", f"{va!r} vs {vb!r}"[:200]))
            continue
        if va.numel() == 0 or torch.equal(va, vb):
            continue
        fa, fb = va.double(), vb.double()
        if not bool(torch.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True).all()):
            delta = (fa - fb).abs()
            finite = delta[~torch.isnan(delta)]
            max_abs = float(finite.max()) if finite.numel() else math.nan
            out.different.append(TensorDiff(key, "values", f"max |a - b| = {max_abs:.6g}", max_abs))
    return out
