"""Ctrl-C anywhere in ``mfsdp-ckpt`` is ``error: interrupted`` and exit code 130.

Inside a command, :func:`cli.common._run` turns ``KeyboardInterrupt`` into that line. Before it
(while click parses the arguments, or a command imports torch), click itself would catch the
interrupt and print ``Aborted!`` with exit code 1; :class:`InterruptibleGroup` catches it first.
It also notes every SIGINT while it runs (:func:`cli.common.note_interrupts`), so that a failure
that follows a Ctrl-C (torch's zip writer fails when the interrupt lands inside ``torch.save``)
is reported as the interrupt, not as the failure."""

from __future__ import annotations

from typing import Any

import click

from .common import _fail, note_interrupts


class InterruptibleGroup(click.Group):
    """A :class:`click.Group` whose parsing and invocation (every subcommand's included, since the
    group invokes them) report a ``KeyboardInterrupt`` as the error boundary does."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's entry point, with SIGINT noted while it runs (the previous handler back after)."""
        restore = note_interrupts()
        try:
            return super().main(*args, **kwargs)
        finally:
            restore()

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        """Parse the group's arguments; an interrupt meanwhile is ``error: interrupted``, 130."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            _fail("interrupted", "KeyboardInterrupt", 130)
            raise  # not reached: _fail exits

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; an interrupt that ``_run`` did not see is ``error: interrupted``, 130."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _fail("interrupted", "KeyboardInterrupt", 130)
            raise  # not reached: _fail exits
