"""``--lora r=8,alpha=16,targets=q_proj,v_proj``: what a LoRA fine-tuning run adds to its model.

Parsed and checked here without torch (the launcher's pre-flight runs it before any rank starts);
:mod:`cli.lora_source` applies it to the model through PEFT. The same values are recorded in every
checkpoint's ``model_source`` (under ``lora``), so a resumed run rebuilds the same adapters
without the flag.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["LoraSpec", "parse_lora", "lora_of_record", "PEFT_HINT", "peft_missing"]

PEFT_HINT = "pip install 'mfsdp-ckpt[lora]'"
_KEYS = ("r", "alpha", "targets", "dropout")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank ``r`` on every linear module whose name ends in one of ``targets``
    (PEFT's ``target_modules``), scaled by ``alpha / r``, with ``dropout`` on their input."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def to_record(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    def __str__(self) -> str:
        dropout = f",dropout={self.dropout:g}" if self.dropout else ""
        return f"r={self.r},alpha={self.alpha:g},targets={','.join(self.targets)}{dropout}"


def parse_lora(spec: str, where: str = "--lora") -> LoraSpec:
    """``r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.05]`` (the names after ``targets=`` run to
    the next ``key=``); ValueError, one line naming ``where`` and the part at fault."""
    values: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in spec.split(",")):
        if "=" in part:
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in _KEYS:
                raise ValueError(f"{where} {spec!r}: unknown key {key!r} (keys: {', '.join(_KEYS)})")
            if key in values:
                raise ValueError(f"{where} {spec!r}: {key} given twice")
            values[key] = [value.strip()]
        elif key == "targets" and part:
            values[key].append(part)
        else:
            raise ValueError(f"{where} {spec!r}: {part!r} is not key=value (e.g. r=8,alpha=16,targets=q_proj,v_proj)")
    missing = [k for k in ("r", "alpha", "targets") if k not in values]
    if missing:
        raise ValueError(f"{where} {spec!r}: {', '.join(missing)} missing (e.g. r=8,alpha=16,targets=q_proj,v_proj)")
    return _checked(values["r"][0], values["alpha"][0], values["targets"], values.get("dropout", ["0"])[0], where)


def _checked(r: Any, alpha: Any, targets: Any, dropout: Any, where: str) -> LoraSpec:
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
    return _checked(
        value.get("r"),
        value.get("alpha"),
        value.get("targets"),
        value.get("dropout", 0.0),
        f"{where}: model_source.lora",
    )


def peft_missing() -> str | None:
    """Why ``--lora`` cannot run here (PEFT not installed), or None; no import of it."""
    if importlib.util.find_spec("peft") is None:
        return f"--lora: the peft package is not installed ({PEFT_HINT})"
    return None
