"""Ctrl-C anywhere in ``mfsdp-ckpt`` is ``error: interrupted`` and exit code 130, unless the
command's output is already committed: then it is reported as written, exit code 0.

Inside a command, :func:`cli.common._run` turns ``KeyboardInterrupt`` into that line. Before it
(while click parses the arguments, or a command imports torch), click itself would catch the
interrupt and print ``Aborted!`` with exit code 1; :class:`InterruptibleGroup` catches it first.
It also notes every SIGINT while it runs (:func:`cli.common.note_interrupts`), so that a failure
that follows a Ctrl-C (torch's zip writer fails when the interrupt lands inside ``torch.save``)
is reported as the interrupt, not as the failure; and once the command's outcome is decided (its
output committed, its result printed, its error about to be), a SIGINT changes it no more.

The program itself (:meth:`InterruptibleGroup.__call__`) ends through ``os._exit`` with the code
it decided: the interpreter's shutdown runs torch's exit handlers, where a Ctrl-C raises (a
traceback), and then gives SIGINT its default action back, where a Ctrl-C kills the process
(exit status -2, and what it printed may be lost)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, NoReturn

import click

from .common import _interrupted, note_interrupts, settle


class InterruptibleGroup(click.Group):
    """A :class:`click.Group` whose parsing and invocation (every subcommand's included, since the
    group invokes them) report a ``KeyboardInterrupt`` as the error boundary does."""

    #: True once :meth:`__call__` runs as the program (its arguments from ``sys.argv``)
    program = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The program's entry point (the console script, ``python -m``: no arguments given, they
        come from ``sys.argv``): :meth:`main`, then the process ends with the exit code it
        decided, output flushed, through ``os._exit`` (see the module docstring). Given its
        arguments (a test's ``main([...])``), click's :meth:`main` as it is."""
        if args or "args" in kwargs:
            return self.main(*args, **kwargs)
        self._exit(self._run_program(**kwargs))

    def _run_program(self, **kwargs: Any) -> int:
        """:meth:`main` as the program; the exit code it decided."""
        self.program = True
        try:
            self.main(**kwargs)
        except SystemExit as e:
            return _exit_code(e)
        return 0

    @staticmethod
    def _exit(code: int) -> NoReturn:
        """End the process with ``code``, stdout and stderr flushed, without the interpreter's
        shutdown (a Ctrl-C from here on changes nothing: :func:`~cli.common.settle`)."""
        settle()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: the code stands
                stream.flush()
        os._exit(code)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's entry point, with SIGINT noted while it runs (the previous handler back after,
        unless this is the program, which keeps it until its end)."""
        restore = note_interrupts()
        try:
            return super().main(*args, **kwargs)
        finally:
            if not self.program:
                restore()

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        """Parse the group's arguments; an interrupt meanwhile is ``error: interrupted``, 130."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            _interrupted()

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; an interrupt that ``_run`` did not see is ``error: interrupted``,
        130. Once it has returned (or exits), its outcome is decided: a SIGINT is ignored."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _interrupted()
        finally:
            settle()


def _exit_code(e: SystemExit) -> int:
    """The exit status ``sys.exit(e.code)`` gives (a message is printed on stderr, status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
