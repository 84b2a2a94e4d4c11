"""LoRA adapters in a checkpoint: the record that says which (``model_source.lora``) and the names
of their tensors.

A LoRA run's checkpoint names every weight of the base model as the base model does
(``model.<fqn>``) and the two factors of each adapted linear layer after it:
``model.<module>.lora_A.weight`` (``r x in``) and ``model.<module>.lora_B.weight`` (``out x r``),
beside the frozen ``model.<module>.weight`` (``out x in``). The adapted layer computes
``x W^T + (alpha / r) x A^T B^T``, so the merged weight is ``W + (alpha / r) B A``. PEFT's own
adapter files name the factors ``base_model.model.<module>.lora_A.weight``.

A record is checked against the adapters present before anything reads them as adapters
(:func:`factor_problem`: the modules adapted are the record's targets, every target has
adapters, the factors have the record's rank; :func:`adapter_pairs` adds their base weights):
the manifest schema on every read, both exports, ``--resume``. ``r`` is at most
:data:`MAX_LORA_R`, and (checked on the model before any adapter is made) at most the smaller
dimension of every layer it adapts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mfsdp_ckpt.errors import ConversionError

__all__ = [
    "MAX_LORA_R",
    "LoraSpec",
    "factor_problem",
    "checked_spec",
    "lora_of_record",
    "adapter_pairs",
    "peft_name",
    "PEFT_PREFIX",
]

PEFT_PREFIX = "base_model.model."  # what PEFT's adapter files put before the model's own names
_FACTOR = re.compile(r"^model\.(.+)\.lora_([AB])\.weight$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: the largest adapter rank a spec may name (a record too): far above any useful LoRA rank (a
#: rank above a layer's smaller dimension adds nothing, and that is checked per layer), far below
#: what would make one adapter of a realistic layer a memory hazard (``2**22`` on a 4096-wide layer
#: is 34 G parameters)
MAX_LORA_R = 1 << 16


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank ``r`` on every linear module whose name ends in one of ``targets``
    (PEFT's ``target_modules``), scaled by ``alpha / r``, with ``dropout`` on their input."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_record(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    def __str__(self) -> str:
        dropout = f",dropout={self.dropout:g}" if self.dropout else ""
        return f"r={self.r},alpha={self.alpha:g},targets={','.join(self.targets)}{dropout}"


def checked_spec(r: Any, alpha: Any, targets: Any, dropout: Any, where: str) -> LoraSpec:
    """The spec of these values; ValueError, one line naming ``where`` and the value at fault."""
    try:
        rank = int(r)
    except (TypeError, ValueError):
        rank = 0
    if isinstance(r, bool) or rank < 1 or str(rank) != str(r).strip():
        raise ValueError(f"{where}: r={r!r}: expected a positive integer (the adapters' rank)")
    if rank > MAX_LORA_R:
        raise ValueError(f"{where}: r={r!r}: more than {MAX_LORA_R} (docs/lora.md: the adapters' rank is bounded)")
    number = _number(alpha)
    if number is None or number <= 0:
        raise ValueError(f"{where}: alpha={alpha!r}: expected a positive number (the scale is alpha / r)")
    drop = _number(dropout)
    if drop is None or not 0 <= drop < 1:
        raise ValueError(f"{where}: dropout={dropout!r}: expected a number in [0, 1)")
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(f"{where}: targets: expected module names (e.g. targets=q_proj,v_proj)")
    for name in targets:
        if not isinstance(name, str) or not _MODULE_NAME.match(name):
            raise ValueError(f"{where}: targets: {name!r} is not a module name (letters, digits, _)")
    if len(set(targets)) != len(targets):
        raise ValueError(f"{where}: targets: a module name is given twice")
    return LoraSpec(rank, number, tuple(targets), drop)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def lora_of_record(record: dict[str, Any], where: str) -> LoraSpec | None:
    """The adapters a checkpoint's ``model_source`` records (None: a model without them);
    ValueError naming ``where`` for a record that is not one."""
    value = record.get("lora")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: model_source.lora is not a JSON object")
    return checked_spec(
        value.get("r"),
        value.get("alpha"),
        value.get("targets"),
        value.get("dropout", 0.0),
        f"{where}: model_source.lora",
    )


def factor_problem(shapes: Mapping[str, Sequence[int] | None], spec: LoraSpec | None) -> str | None:
    """What in the LoRA factors among ``shapes`` (checkpoint key -> shape, or None where the shape
    is not known) disagrees with the record ``spec``, in words naming the key, or None. Factors without a
    record or a record without factors, a factor without its partner, a module adapted that the
    targets do not name, a target with no adapter, a factor whose shape is not ``r x in`` /
    ``out x r`` at the recorded rank. What a base weight adds is :func:`adapter_pairs`'."""
    factors: dict[str, dict[str, str]] = {}
    for key in shapes:
        if m := _FACTOR.match(key):
            factors.setdefault(m.group(1), {})[m.group(2)] = key
    if not factors:
        return None if spec is None else f"model_source records LoRA adapters ({spec}) but it holds none"
    if spec is None:
        first = sorted(k for f in factors.values() for k in f.values())[0]
        return f"{first} is a LoRA factor but model_source records no lora (its scale)"
    adapted = set()
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            have = next(iter(pair.values()))
            return f"{have} has no partner lora_{'B' if 'A' in pair else 'A'}"
        target = module.rpartition(".")[2]
        if target not in spec.targets:
            named = ", ".join(spec.targets)
            return f"{pair['A']} adapts {target!r}, which model_source.lora's targets ({named}) do not name"
        adapted.add(target)
        a, b = shapes[pair["A"]], shapes[pair["B"]]
        if (a is not None and (len(a) != 2 or a[0] != spec.r)) or (b is not None and (len(b) != 2 or b[1] != spec.r)):
            shown_a, shown_b = (tuple(s) if s is not None else "?" for s in (a, b))
            return f"{pair['A']} {shown_a} and {pair['B']} {shown_b} are not factors of rank r={spec.r}"
    missing = [t for t in spec.targets if t not in adapted]
    if missing:
        return f"model_source.lora targets {missing[0]!r}, but the checkpoint holds no adapter of it"
    return None


def adapter_pairs(shapes: dict[str, tuple[int, ...]], spec: LoraSpec | None, where: str) -> dict[str, tuple[str, str]]:
    """``model.<module>.weight`` -> its ``(lora_A, lora_B)`` keys, for the model tensors ``shapes``
    (checkpoint key -> shape) of a checkpoint whose record says ``spec``. ConversionError, one line
    naming the key, for adapters without a record or a record without adapters, a factor without
    its partner or its base weight, and shapes that do not compose (``A: r x in``,
    ``B: out x r``, ``W: out x in``)."""
    problem = factor_problem(dict.fromkeys(shapes), spec)  # names only: the shapes are checked below, with W
    if problem is not None:
        raise ConversionError(f"{where}: {problem}")
    factors: dict[str, dict[str, str]] = {}
    for key in shapes:
        if m := _FACTOR.match(key):
            factors.setdefault(m.group(1), {})[m.group(2)] = key
    out = {}
    for module, pair in sorted(factors.items()):
        assert spec is not None
        base = f"model.{module}.weight"
        if base not in shapes:
            raise ConversionError(f"{where}: {pair['A']} adapts {base}, which the checkpoint does not hold")
        a, b, w = (tuple(shapes[k]) for k in (pair["A"], pair["B"], base))
        if len(w) != 2 or a != (spec.r, w[1]) or b != (w[0], spec.r):
            raise ConversionError(
                f"{where}: {pair['A']} {a} and {pair['B']} {b} do not adapt {base} {w} with r={spec.r}"
            )
        out[base] = (pair["A"], pair["B"])
    return out


def peft_name(key: str) -> str:
    """PEFT's adapter-file name of the factor ``model.<module>.lora_A.weight``."""
    return PEFT_PREFIX + key[len("model.") :]
