"""What every command shares: one-line errors with exit 1, byte sizes, a progress bar."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import click

from mfsdp_ckpt.errors import CheckpointError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _debug() -> bool:
    """``mfsdp-ckpt --debug ...`` (or ``MFSDP_DEBUG=1``): show tracebacks instead of one line."""
    ctx = click.get_current_context(silent=True)
    flag = bool(ctx and ctx.find_root().params.get("debug"))
    return flag or os.environ.get("MFSDP_DEBUG", "") not in ("", "0")


def _run(fn: Callable[[], Any]) -> Any:
    """The error boundary of every command: whatever goes wrong is one line on stderr and exit
    code 1 (130 when interrupted); ``--debug`` shows the traceback instead."""
    try:
        return fn()
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the boundary: nothing escapes as a traceback
        if _debug():
            raise
        if isinstance(e, CheckpointError):
            click.echo(f"error: {e}", err=True)
        elif isinstance(e, OSError):
            click.echo(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", err=True)
        else:
            first = (str(e).splitlines() or [""])[0][:300]
            click.echo(f"error: {type(e).__name__}: {first} (an internal error: run with --debug for the traceback)",
                       err=True)
        sys.exit(1)


class _Progress:
    """A tqdm bar on stderr when it is a terminal (nothing otherwise): ``bar(done, total)``."""

    def __init__(self, desc: str, unit: str = "B") -> None:
        self.desc, self.unit, self.bar = desc, unit, None
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=self.unit == "B", unit_divisor=1024,
                            dynamic_ncols=True, leave=False, file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_with_progress(desc: str, fn: Callable[[_Progress], Any], unit: str = "B") -> Any:
    """:func:`_run` of ``fn(bar)`` with a progress bar that is closed however ``fn`` ends."""
    bar = _Progress(desc, unit)
    try:
        return _run(lambda: fn(bar))
    finally:
        bar.close()
