"""What every command shares: one-line errors with exit 1, byte sizes, a progress bar."""

from __future__ import annotations

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


def _run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CheckpointError as e:
        click.echo(f"error: {e}", err=True)
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
