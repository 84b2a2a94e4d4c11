"""The trainer's everyday flows as a user meets them: ``--help`` / ``--version`` and the refusals the
flags alone decide answer without torch (and before any rank starts), a resume from a given
checkpoint path needs no ``--ckpt-dir``, a refusal creates nothing, and an ``--init-from`` of a
Hugging Face directory points to the way that reads it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# run the trainer's front end in a fresh interpreter; print whether torch (or the project's heavy
# packages) were imported by the time it returned
_PROBE = """
import sys
from cli.train import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "mfsdp_core", "mfsdp_ckpt") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _front_end(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag: str) -> None:
    out = _front_end(flag)
    assert out.returncode == 0, out.stderr
    assert "mfsdp-train" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "HEAVY=", out.stderr


def test_the_light_parser_names_what_the_runtime_has() -> None:
    """The presets, strategies, default policy and token dtypes ``--help`` lists without torch are
    the runtime's own."""
    from cli import train_args
    from mfsdp_core.data import TOKEN_DTYPES
    from mfsdp_core.models.gpt import PRESETS
    from mfsdp_core.plan import DEFAULT_POLICY, DEFAULT_STRATEGY
    from mfsdp_core.strategy import STRATEGY_NAMES

    assert train_args.PRESET_NAMES == tuple(PRESETS)
    assert train_args.DEFAULT_PRESET in PRESETS
    assert train_args.STRATEGY_NAMES == tuple(STRATEGY_NAMES)
    assert train_args.DEFAULT_STRATEGY == DEFAULT_STRATEGY.value
    assert train_args.DEFAULT_POLICY == str(DEFAULT_POLICY)
    assert train_args.TOKEN_DTYPE_NAMES == tuple(sorted(TOKEN_DTYPES))


def _help_entries() -> dict[str, str]:
    """``--flag -> its help text`` (one line) from ``--help``'s option entries."""
    import re

    from cli.train_args import build_parser

    entries: dict[str, str] = {}
    flag = None
    for line in build_parser().format_help().split("options:", 1)[1].splitlines():
        start = re.match(r"^  (-\S+)", line)
        if start:
            flag = start.group(1).rstrip(",")
            entries[flag] = line
        elif flag is not None and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_help_shows_every_default() -> None:
    """Each flag with a default says it (0 included: it is not ``False``)."""
    entries = _help_entries()
    for flag, default in [
        ("--seq-len", "64"),
        ("--weight-decay", "0.01"),
        ("--seed", "0"),
        ("--save-every", "0"),
        ("--log-every", "1"),
        ("--keep", "keep all"),
        ("--steps", "100"),
        ("--batch-size", "12"),
    ]:
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])


def test_logging_flags_for_the_other_parts() -> None:
    """``--verbose`` and ``--tensorboard DIR`` parse (their users read ``args.verbose`` and
    ``args.tensorboard``)."""
    from cli.train_args import parse_args

    args = parse_args(["--verbose", "--tensorboard", "tb"])
    assert args.verbose is True and args.tensorboard == "tb"
    args = parse_args([])
    assert args.verbose is False and args.tensorboard is None
