"""Where the tests find torchao, the MXFP8 parity reference.

The Makefile installs torchao (``--no-deps``, so that it never pulls another torch) into a
directory of its own inside the virtual environment, not into its ``site-packages``:
``transformers`` imports torchao whenever it can (its quantizer registry, on every model
load), which costs each process that loads a model about 0.2-0.3 s and prints two
``Failed to load …so`` lines. Only the tests that want torchao put it on their path: the
parity tests (``tests/mfsdp_core/test_mx.py``) and the run that shows the trainer silencing its
lines (``tests/cli/test_train_quiet.py``)."""

from __future__ import annotations

import os
import sys

#: the Makefile's ``pip install --target`` directory for torchao
TORCHAO_DIR = os.path.join(sys.prefix, "torchao-ref")


def with_torchao(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`TORCHAO_DIR` last on ``PYTHONPATH``, for a child process that must see
    torchao (last: the wheel also installs a top-level ``test`` package)."""
    path = env.get("PYTHONPATH", "")
    return dict(env, PYTHONPATH=(path + os.pathsep if path else "") + TORCHAO_DIR)
