"""LoRA adapters in a checkpoint: the record that says which (``model_source.lora``) and the names
of their tensors.

A LoRA run's checkpoint names every weight of the base model as the base model does
(``model.<fqn>``) and the two factors of each adapted linear layer after it:
``model.<module>.lora_A.weight`` (``r x in``) and ``model.<module>.lora_B.weight`` (``out x r``),
beside the frozen ``model.<module>.weight`` (``out x in``). The adapted layer computes
``x W^T + (alpha / r) x A^T B^T``, so the merged weight is ``W + (alpha / r) B A``. PEFT's own
adapter files name the factors ``base_model.model.<module>.lora_A.weight``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mfsdp_ckpt.errors import ConversionError

__all__ = [
    "LoraSpec",
    "checked_spec",
    "lora_of_record",
    "adapter_pairs",
    "peft_name",
    "PEFT_PREFIX",
]

PEFT_PREFIX = "base_model.model."  # what PEFT's adapter files put before the model's own names
_FACTOR = re.compile(r"^model\.(.+)\.lora_([AB])\.weight$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def adapter_pairs(shapes: dict[str, tuple[int, ...]], spec: LoraSpec | None, where: str) -> dict[str, tuple[str, str]]:
    """``model.<module>.weight`` -> its ``(lora_A, lora_B)`` keys, for the model tensors ``shapes``
    (checkpoint key -> shape) of a checkpoint whose record says ``spec``. ConversionError, one line
    naming the key, for adapters without a record or a record without adapters, a factor without
    its partner or its base weight, and shapes that do not compose (``A: r x in``,
    ``B: out x r``, ``W: out x in``)."""
    factors: dict[str, dict[str, str]] = {}
    for key in shapes:
        if m := _FACTOR.match(key):
            factors.setdefault(m.group(1), {})[m.group(2)] = key
    if not factors:
        if spec is not None:
            raise ConversionError(f"{where}: model_source records LoRA adapters ({spec}) but it holds none")
        return {}
    if spec is None:
        first = sorted(k for f in factors.values() for k in f.values())[0]
        raise ConversionError(f"{where}: {first} is a LoRA factor but model_source records no lora (its scale)")
    out = {}
    for module, pair in sorted(factors.items()):
        base = f"model.{module}.weight"
        if set(pair) != {"A", "B"}:
            have = next(iter(pair.values()))
            raise ConversionError(f"{where}: {have} has no partner lora_{'B' if 'A' in pair else 'A'}")
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
