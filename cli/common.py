"""What every command shares: one-line errors with exit 1, byte sizes, a progress bar."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

import click


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


def _as_json() -> bool:
    """Whether the running command was given ``--json``."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.params.get("as_json"))


def _fail(message: str, kind: str, code: int = 1) -> None:
    """Report a failure as one line on stderr (a JSON object ``{"error", "kind"}`` under
    ``--json``) and exit with ``code``."""
    if _as_json():
        click.echo(json.dumps({"error": message, "kind": kind}), err=True)
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


_interrupted_at: float | None = None  # when :func:`_on_sigint` first ran: a Ctrl-C reached this process
_RELAYED_WITHIN_S = 1.0  # a SIGINT this soon after the first is the same Ctrl-C, relayed


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's own SIGINT handler (raise ``KeyboardInterrupt``), noting when the first came. A
    second one within :data:`_RELAYED_WITHIN_S` is the same Ctrl-C passed on by a wrapper that
    forwards it to its process group (``timeout``, a launcher): ignored, so that it cannot cut
    short the clean-up of the first (a staging directory left behind); a later one raises."""
    global _interrupted_at
    now = time.monotonic()
    if _interrupted_at is not None and now - _interrupted_at < _RELAYED_WITHIN_S:
        return
    if _interrupted_at is None:
        _interrupted_at = now
    raise KeyboardInterrupt


def note_interrupts() -> Callable[[], None]:
    """From now on note every SIGINT (still raising ``KeyboardInterrupt``, as Python does), so
    that the error boundary reports a failure that follows a Ctrl-C as the interrupt it is, even
    where the interrupt itself was swallowed on the way up. Returns the function that puts the
    previous handler back, unless a Ctrl-C came: then the process is on its way out with 130, and
    the same Ctrl-C relayed during its exit must not print a traceback. (Python lets only the main
    thread set handlers; elsewhere, nothing.)"""
    global _interrupted_at
    _interrupted_at = None
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, _on_sigint)

    def restore() -> None:
        if _interrupted_at is None:
            signal.signal(signal.SIGINT, previous)

    return restore


def _run(fn: Callable[[], Any]) -> Any:
    """The error boundary of every command: whatever goes wrong is one line on stderr and exit
    code 1 (130 when interrupted: a ``KeyboardInterrupt``, an error raised while one unwound, such
    as torch's zip writer's ``RuntimeError`` when Ctrl-C lands inside ``torch.save``, or any
    failure after a Ctrl-C); ``--debug`` shows the traceback instead."""
    from mfsdp_ckpt.errors import (  # here, not at the top: ``--help`` imports no torch
        CheckpointError,
        one_line,
    )

    try:
        return fn()
    except KeyboardInterrupt:
        _fail("interrupted", "KeyboardInterrupt", 130)
    except Exception as e:  # the boundary: nothing escapes as a traceback
        if _debug():
            raise
        from mfsdp_ckpt.storage.write_errors import interrupt_behind

        if _interrupted_at is not None or interrupt_behind(e) is not None:
            _fail("interrupted", "KeyboardInterrupt", 130)
        text = one_line(e)  # one line, whatever the exception held
        if isinstance(e, CheckpointError):
            _fail(text, type(e).__name__)
        elif type(e).__name__ == "NoCredentialsError":  # botocore's, raised by any s3:// request
            from mfsdp_ckpt.storage.objstore import NO_CREDENTIALS

            _fail(NO_CREDENTIALS, type(e).__name__)
        elif isinstance(e, OSError):
            _fail(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or text}", type(e).__name__)
        else:
            _fail(
                f"{type(e).__name__}: {one_line(e, 300)} (an internal error: run with --debug for the traceback)",
                type(e).__name__,
            )


class LazyChoice(click.Choice):
    """A :class:`click.Choice` whose choices come from ``load()`` when first needed, so that
    defining the commands (and ``mfsdp-ckpt --help``) imports no torch."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self._load())

    @choices.setter
    def choices(self, value: Any) -> None:  # click's __init__ assigns the (empty) placeholder
        pass


def cast_choices() -> tuple[str, ...]:
    """The dtypes ``--dtype`` may cast weights to (imported on use: it needs torch)."""
    from mfsdp_core.dtypes import CAST_CHOICES

    return CAST_CHOICES


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

            self.bar = tqdm(
                total=total,
                desc=self.desc,
                unit=self.unit,
                unit_scale=self.unit == "B",
                unit_divisor=1024,
                dynamic_ncols=True,
                leave=False,
                file=sys.stderr,
            )
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
