"""The canonical key spellings of a checkpoint, in one place.

A checkpoint is a flat dict as DCP sees it:

- ``model.<fqn>``: weights, in the model's dtype, full logical shape;
- ``optim.<fqn>.<state>``: per-parameter optimizer state (``main_param`` for fp32 master weights
  of a low-precision model, ``exp_avg``, ``momentum_buffer``, …) and scalars such as Adam's
  ``step``; ``optim.param_groups``: hyper-parameters, parameters named, never indexed;
- ``grad.<fqn>``: reduced gradients, when asked;
- ``mx.<fqn>.<plane>``: MXFP8 planes;
- ``extra.<name>``: trainer state; ``extra.rng.rank<r>`` each rank's RNG state.
"""

from __future__ import annotations

from typing import Container

__all__ = [
    "GROUPS",
    "PARAM_GROUPS",
    "MAIN_PARAM",
    "RNG_PREFIX",
    "model_key",
    "optim_key",
    "grad_key",
    "extra_key",
    "rng_key",
    "group_of",
    "is_rng",
    "param_of",
    "extra_name",
    "fqn_of_model_key",
    "mx_key",
    "mx_plane_of",
]

GROUPS = ("model", "optim", "grad", "mx", "extra")
PARAM_GROUPS = "optim.param_groups"
MAIN_PARAM = "main_param"
RNG_PREFIX = "extra.rng.rank"


def model_key(fqn: str) -> str:
    return f"model.{fqn}"


def optim_key(fqn: str, state: str) -> str:
    return f"optim.{fqn}.{state}"


def grad_key(fqn: str) -> str:
    return f"grad.{fqn}"


def mx_key(fqn: str, plane: str) -> str:
    return f"mx.{fqn}.{plane}"


def mx_plane_of(key: str) -> tuple[str, str] | None:
    """``(fqn, plane)`` of ``mx.<fqn>.<plane>``, else None."""
    if not key.startswith("mx.") or key.count(".") < 2:
        return None
    fqn, plane = key[len("mx.") :].rsplit(".", 1)
    return fqn, plane


def extra_key(name: str) -> str:
    return f"extra.{name}"


def rng_key(rank: int) -> str:
    return f"{RNG_PREFIX}{rank}"


def group_of(key: str) -> str:
    """``model`` / ``optim`` / ``grad`` / ``mx`` / ``extra``, or ``other``."""
    head = key.split(".", 1)[0]
    return head if head in GROUPS else "other"


def is_rng(key: str) -> bool:
    return key.startswith(RNG_PREFIX)


def extra_name(key: str) -> str | None:
    """``name`` of ``extra.<name>`` (RNG states excluded), else None."""
    if key.startswith("extra.") and not is_rng(key):
        return key[len("extra.") :]
    return None


def fqn_of_model_key(key: str) -> str | None:
    """``<fqn>`` of ``model.<fqn>``, else None."""
    return key[len("model.") :] if key.startswith("model.") else None


def param_of(key: str, params: Container[str]) -> str | None:
    """The parameter (one of ``params``) a per-element key belongs to: ``model.<p>``,
    ``grad.<p>``, ``optim.<p>.<state>``; None for anything else."""
    if key.startswith(("model.", "grad.")):
        name = key.split(".", 1)[1]
        return name if name in params else None
    if key.startswith("optim."):
        name = key[len("optim.") :].rsplit(".", 1)[0]
        return name if name in params else None
    return None
