"""Compare two checkpoints logically, whatever layouts wrote them.

Each tensor is read whole (assembled from whichever chunks hold it, every chunk verified) one key
at a time, so memory stays bounded by the largest tensor of the two checkpoints, not by their size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mfsdp_ckpt.format.keys import RNG_PREFIX

__all__ = ["TensorDiff", "CheckpointDiff", "diff_checkpoints", "HISTOGRAM_BINS"]

#: the bins of a differing tensor's |a - b| histogram: exactly equal, one per decade from 1e-12 up to
#: 1e3, above it, and NaN / inf (a NaN against a number, or infinities that differ)
HISTOGRAM_BINS = ("0", "<=1e-12", *(f"<=1e{k}" for k in range(-11, 4)), ">1e3", "nan/inf")


@dataclass(frozen=True)
class TensorDiff:
    key: str
    problem: str  # "shape", "dtype", "values" or "object"
    detail: str
    max_abs: float | None = None
    rel: float | None = None  # ||a - b||_2 / ||b||_2 over the finite differences (inf when b is all zero)
    histogram: list[int] | None = None  # elements per bin of |a - b| (HISTOGRAM_BINS)
    # (a, b) where each side is one number (a one-element tensor, an int or float object): how a
    # counter such as Adam's ``step`` moved. For the pages (``diff --html``); not in ``--json``
    numbers: tuple[float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as ``diff --json`` gives it: what does not apply is absent, not null."""
        return {k: v for k, v in self.__dict__.items() if v is not None and k not in _PAGE_ONLY}


#: fields of :class:`TensorDiff` that only the pages show
_PAGE_ONLY = ("numbers",)


@dataclass
class CheckpointDiff:
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    different: list[TensorDiff] = field(default_factory=list)
    compared: int = 0
    #: every common entry compared, in order, with A's shape (None: an object): for the pages,
    #: which tell what was found equal and which entries are one number (a counter)
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.different)

    def to_json(self) -> dict[str, Any]:
        """docs/cli.md's JSON vocabulary: an entry's ``max_abs``, ``rel`` and ``histogram`` are absent
        (not null) where they do not apply (a shape, dtype or object difference)."""
        return {
            "equal": self.equal,
            "compared": self.compared,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "different": [d.to_json() for d in self.different],
            "counts": self.counts,
        }

    @property
    def counts(self) -> dict[str, int]:
        """How many common entries are equal (within the tolerances) and how many differ, and how
        many keys only one side has: the figures of diff's summary line."""
        return {
            "equal": self.compared - len(self.different),
            "different": len(self.different),
            "only_in_a": len(self.only_in_a),
            "only_in_b": len(self.only_in_b),
        }


def diff_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    ignore: tuple[str, ...] = (RNG_PREFIX,),
    progress: Callable[[int, int], None] | None = None,
    key_map_a: Sequence[str] = (),
    key_map_b: Sequence[str] = (),
) -> CheckpointDiff:
    """Keys only in one checkpoint, shape / dtype changes, and tensors whose values differ by more
    than ``atol + rtol * |b|`` anywhere (reporting max |a - b|; NaNs in the same places are equal).
    Keys starting with a prefix in ``ignore`` are skipped (by default the per-rank RNG states,
    which depend on the world size). ``progress(done, total)`` counts entries compared.

    Entries are compared by canonical name: a stock DCP checkpoint (FSDP2's ``get_state_dict``
    layout, or any without ``mfsdp.json``) is read through its key layout, and ``key_map_a`` /
    ``key_map_b`` rename prefixes of A's / B's keys first (``=model.`` for torchtitan's bare
    FQNs), so that a stock checkpoint and its ``reshard`` compare equal."""
    from mfsdp_ckpt.read.mapped import MappedReader
    from mfsdp_ckpt.read.stock import parse_key_map

    rules_a, rules_b = parse_key_map(key_map_a), parse_key_map(key_map_b)
    with MappedReader(os.fspath(a), rules_a) as ra, MappedReader(os.fspath(b), rules_b) as rb:
        keys_a = {k for k in ra.keys() if not k.startswith(ignore)}
        keys_b = {k for k in rb.keys() if not k.startswith(ignore)}
        out = CheckpointDiff(only_in_a=sorted(keys_a - keys_b), only_in_b=sorted(keys_b - keys_a))
        common = sorted(keys_a & keys_b)
        for done, key in enumerate(common, 1):
            out.compared += 1
            out.shapes[key] = tuple(ra.shape(key)) if ra.is_tensor(key) else None
            problem = _compare(ra, rb, key, atol, rtol)
            if problem is not None:
                out.different.append(problem)
            if progress is not None:
                progress(done, len(common))
    return out


def _compare(ra: Any, rb: Any, key: str, atol: float, rtol: float) -> TensorDiff | None:
    tensor_a, tensor_b = ra.is_tensor(key), rb.is_tensor(key)
    if tensor_a != tensor_b:
        return TensorDiff(key, "object", "a tensor in one checkpoint, an object in the other")
    if tensor_a and ra.shape(key) != rb.shape(key):
        return TensorDiff(key, "shape", f"{tuple(ra.shape(key))} vs {tuple(rb.shape(key))}")
    va, vb = ra.read(key), rb.read(key)
    if not tensor_a:
        if _same_object(va, vb):
            return None
        where, da, db = _first_difference(va, vb)
        detail = f"{where + ': ' if where else ''}{_repr(da)} vs {_repr(db)}"
        return TensorDiff(key, "object", detail, numbers=_numbers(va, vb))
    if va.dtype != vb.dtype:
        return _compare_cast(key, va, vb, atol, rtol)
    return _compare_values(key, va, vb, atol, rtol)


def _compare_cast(key: str, va: torch.Tensor, vb: torch.Tensor, atol: float, rtol: float) -> TensorDiff | None:
    """Two tensors of different dtypes, compared by value in the wider one (float64 holds both).
    With ``atol = rtol = 0`` the dtype change alone makes them different (problem ``dtype``, the
    detail saying how the values compare); with a tolerance, values within it count as equal and
    values beyond it are a ``values`` difference whose detail names both dtypes."""
    dtypes = f"{va.dtype} vs {vb.dtype}"
    wide = va.double() if va.dtype.is_floating_point or vb.dtype.is_floating_point else va.long()
    other = vb.to(wide.dtype)
    values = _compare_values(key, wide, other, atol, rtol)
    if atol == 0 and rtol == 0:
        said = f"; {values.detail}" if values is not None else "; values equal after casting"
        if values is None:
            return TensorDiff(key, "dtype", dtypes + said)
        return TensorDiff(key, "dtype", dtypes + said, values.max_abs, values.rel, numbers=values.numbers)
    if values is None:
        return None
    return TensorDiff(
        key, "values", f"{dtypes}; {values.detail}", values.max_abs, values.rel, values.histogram, values.numbers
    )


def _compare_values(key: str, va: torch.Tensor, vb: torch.Tensor, atol: float, rtol: float) -> TensorDiff | None:
    """Two tensors of one dtype and shape: ``None`` when equal within ``atol + rtol * |b|``
    (NaNs in the same places equal), else the worst mismatch, max |a - b|, rel and histogram."""
    if va.numel() == 0 or torch.equal(va, vb):
        return None
    fa, fb = va.double(), vb.double()
    if bool(torch.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True).all()):
        return None
    delta = (fa - fb).abs()
    finite = delta[~torch.isnan(delta)]
    max_abs = float(finite.max()) if finite.numel() else math.nan
    # the worst mismatch (a NaN against a number counts as the largest), with both values in full
    mismatch = ~torch.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True)
    score = torch.where(mismatch, torch.nan_to_num(delta, nan=math.inf), torch.zeros_like(delta))
    at = [int(i) for i in torch.unravel_index(torch.argmax(score), va.shape)] if va.dim() else []
    a_at, b_at = (va[tuple(at)], vb[tuple(at)]) if at else (va, vb)
    norm_b = float(torch.linalg.vector_norm(torch.nan_to_num(fb, nan=0.0, posinf=0.0, neginf=0.0)))
    norm_d = float(torch.linalg.vector_norm(finite)) if finite.numel() else math.nan
    rel = norm_d / norm_b if norm_b else (0.0 if norm_d == 0 else math.inf)
    return TensorDiff(
        key,
        "values",
        f"max |a - b| = {max_abs:.6g} at {at}: a = {a_at.item()!r}, b = {b_at.item()!r}",
        max_abs,
        rel,
        _histogram(delta),
        (float(va.reshape(-1)[0]), float(vb.reshape(-1)[0])) if va.numel() == 1 else None,
    )


def _numbers(a: Any, b: Any) -> tuple[float, float] | None:
    """``(a, b)`` as floats when both are plain numbers (an int or float, not a bool), else None:
    an object entry that is a counter (``extra.step``)."""
    plain = (int, float)
    if isinstance(a, plain) and isinstance(b, plain) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a), float(b)
    return None


def _histogram(delta: torch.Tensor) -> list[int]:
    """Counts of ``delta`` (|a - b|, float64) per :data:`HISTOGRAM_BINS`."""
    flat = delta.reshape(-1)
    bad = ~torch.isfinite(flat)
    good = flat[~bad]
    zero = good == 0
    decades = torch.ceil(torch.log10(good[~zero])).clamp(-12, 4).long() + 12  # <=1e-12 -> 0, >1e3 -> 16
    counts = torch.bincount(decades, minlength=17).tolist()
    return [int(zero.sum()), *counts, int(bad.sum())]


def _same_object(a: Any, b: Any) -> bool:
    """Whether two loaded objects are equal: containers element by element, tensors with
    ``torch.equal`` (plain ``==`` on a container of tensors raises), anything else with ``==``;
    objects that cannot be compared (too deep, comparison raising) count as different."""
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(_same_object(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(_same_object(x, y) for x, y in zip(a, b))
        return bool(a == b)
    except (RecursionError, RuntimeError, TypeError, ValueError):
        return False


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any]:
    """The path (``[0]['lr']``) of the first place two unequal objects differ, and the two values
    there: a diff reports those in full rather than cutting both objects short."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            if not _same_object(a[k], b[k]):
                return _first_difference(a[k], b[k], f"{where}[{k!r}]")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if not _same_object(x, y):
                return _first_difference(x, y, f"{where}[{i}]")
    return where, a, b


def _repr(value: Any) -> str:
    """A value's repr on one line, whole."""
    try:
        return " ".join(repr(value).split())
    except (RecursionError, RuntimeError, TypeError, ValueError):
        return f"<{type(value).__name__}>"
