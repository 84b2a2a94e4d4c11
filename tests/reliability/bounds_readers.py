"""The reading side of tests/reliability/test_hostile_bounds.py (no tests here), run in a
subprocess under an address-space cap (``RLIMIT_AS``), so that a reader allocating what a
hostile size asks for fails the case with a MemoryError instead of swapping.

Reads a JSON list of jobs on stdin and writes one JSON result per job on stdout, in order:

- ``{"argv": [...]}``: ``mfsdp-ckpt ARGV`` run in this process (click's runner):
  ``{"exit": code, "stderr": text}``;
- ``{"load": CKPT}``: ``mfsdp_ckpt.load`` of ``CKPT`` into the test MLP:
  ``{"exit": 0 or 1, "stderr": "<class>: <message>"}`` (0: loaded).

An exception other than a ``CheckpointError`` is reported as the class and message, so that the
test names it; nothing is raised out of a job."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any


def _cli(argv: list[str]) -> dict[str, Any]:
    from click.testing import CliRunner

    from cli.main import main

    result = CliRunner().invoke(main, argv)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += f"{type(result.exception).__name__}: {result.exception}"
    return {"exit": result.exit_code, "stderr": stderr}


def _load(ckpt: str, model: Any, optim: Any) -> dict[str, Any]:
    import mfsdp_ckpt

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mfsdp_ckpt.load(ckpt, model, optim)
    except Exception as e:  # noqa: BLE001 - reported to the test, which names the class
        return {"exit": 1, "stderr": f"{type(e).__name__}: {e}\n"}
    return {"exit": 0, "stderr": ""}


def main() -> None:
    jobs = json.load(sys.stdin)
    model = optim = None
    for job in jobs:
        if "argv" in job:
            out = _cli(job["argv"])
        else:
            if model is None:
                from tests.reliability.test_hostile_support import trained_mlp

                model, optim = trained_mlp()
            out = _load(job["load"], model, optim)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
