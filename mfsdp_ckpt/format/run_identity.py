"""The identity of a training run, recorded in every checkpoint it writes.

A run made by a fresh start gets a new random token; a resume or a restart carries over the
token of the checkpoint it continues (durable or memory-tier), so every checkpoint of one run,
across its restarts, carries the same one. It lives in the manifest's ``run_config`` (under
:data:`RUN_IDENTITY_KEY`), beside the recorded settings, and is no setting: ``--resume`` never
compares it as one. What it decides: a memory-tier snapshot competes with the durable ``latest``
of the run directory only when both carry the same identity (a snapshot of another run that
used the same ``--ckpt-dir`` is passed over, whatever its step). Pure: no I/O, no torch.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

__all__ = ["RUN_IDENTITY_KEY", "new_identity", "identity_of"]

RUN_IDENTITY_KEY = "run_identity"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")


def new_identity() -> str:
    """A new run's identity: 128 random bits, as 32 hex digits."""
    return secrets.token_hex(16)


def identity_of(manifest: dict[str, Any] | None) -> str | None:
    """The run identity a manifest records (None: none, from a writer that recorded none, or
    not a token of :func:`new_identity`'s form)."""
    run_config = (manifest or {}).get("run_config")
    value = run_config.get(RUN_IDENTITY_KEY) if isinstance(run_config, dict) else None
    return value if isinstance(value, str) and _TOKEN.match(value) else None
