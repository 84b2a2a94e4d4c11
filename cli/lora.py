"""``--lora r=8,alpha=16,targets=q_proj,v_proj``: what a LoRA fine-tuning run adds to its model.

Parsed and checked here without torch (the launcher's pre-flight runs it before any rank starts);
:mod:`cli.lora_source` applies it to the model through PEFT. The same values are recorded in every
checkpoint's ``model_source`` (under ``lora``: :mod:`mfsdp_ckpt.format.lora`), so a resumed run
rebuilds the same adapters without the flag.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the light parser (``--help``, the launcher's refusals) imports no mfsdp_ckpt
    from mfsdp_ckpt.format.lora import LoraSpec

__all__ = ["parse_lora", "PEFT_HINT", "peft_missing"]

PEFT_HINT = "pip install 'mfsdp-ckpt[lora]'"
_KEYS = ("r", "alpha", "targets", "dropout")


def parse_lora(spec: str, where: str = "--lora") -> LoraSpec:
    """``r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.05]`` (the names after ``targets=`` run to
    the next ``key=``); ValueError, one line naming ``where`` and the part at fault."""
    from mfsdp_ckpt.format.lora import checked_spec  # only a run that names --lora pays for it

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
    return checked_spec(values["r"][0], values["alpha"][0], values["targets"], values.get("dropout", ["0"])[0], where)


def peft_missing() -> str | None:
    """Why ``--lora`` cannot run here (PEFT not installed), or None; no import of it."""
    if importlib.util.find_spec("peft") is None:
        return f"--lora: the peft package is not installed ({PEFT_HINT})"
    return None
