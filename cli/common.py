"""What every command shares: one-line errors with exit 1, byte sizes, a progress bar; what a
Ctrl-C means (with :mod:`cli.interrupt`); and the refusals a command makes from its arguments and
local paths alone, before torch is imported (about 2 s), in the one line the library would give."""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

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


def _fail(message: str, kind: str, code: int = 1) -> NoReturn:
    """Report a failure as one line on stderr (a JSON object ``{"error", "kind"}`` under
    ``--json``) and exit with ``code``; a Ctrl-C meanwhile changes neither (:func:`settle`)."""
    settle()
    if _as_json():
        click.echo(json.dumps({"error": message, "kind": kind}), err=True)
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


_interrupted_at: float | None = None  # when :func:`_on_sigint` first raised: a Ctrl-C reached this process
_RELAYED_WITHIN_S = 1.0  # a SIGINT this soon after the first is the same Ctrl-C, relayed
_settled = False  # the command's outcome is decided (:func:`settle`): a SIGINT no longer raises


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's own SIGINT handler (raise ``KeyboardInterrupt``), noting when the first came. None
    is raised once the outcome is decided (:func:`settle`) or the command's output is committed
    (:func:`guard_output`): the command then reports what it did, and exits 0 after a commit. A
    second one within :data:`_RELAYED_WITHIN_S` is the same Ctrl-C passed on by a wrapper that
    forwards it to its process group (``timeout``, a launcher): ignored, so that it cannot cut
    short the clean-up of the first (a staging directory left behind); a later one raises."""
    global _interrupted_at
    if _settled or (_output is not None and _output.committed()):
        return
    now = time.monotonic()
    if _interrupted_at is not None and now - _interrupted_at < _RELAYED_WITHIN_S:
        return
    if _interrupted_at is None:
        _interrupted_at = now
    raise KeyboardInterrupt


def note_interrupts() -> Callable[[], None]:
    """From now on note every SIGINT (still raising ``KeyboardInterrupt``, as Python does, see
    :func:`_on_sigint`), so that the error boundary reports a failure that follows a Ctrl-C as
    the interrupt it is, even where the interrupt itself was swallowed on the way up. Returns the
    function that puts the previous handler back, unless a Ctrl-C came: then the process is on
    its way out with 130, and the same Ctrl-C relayed during its exit must not print a
    traceback. (Python lets only the main thread set handlers; elsewhere, nothing.)"""
    global _interrupted_at, _settled, _output
    _interrupted_at, _settled, _output = None, False, None
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, _on_sigint)

    def restore() -> None:
        if _interrupted_at is None:
            signal.signal(signal.SIGINT, previous)

    return restore


def settle() -> None:
    """The command's outcome is decided (its result is printed, or its error is about to be):
    from now on a SIGINT is ignored, so that it can neither turn the outcome into another nor
    cut its report short."""
    global _settled
    _settled = True


@dataclass(frozen=True)
class _Output:
    """A local destination a command writes: its path, what was there when the command started
    (``(st_dev, st_ino)``, None: nothing) and the staging siblings (``.<name>.partial-*``) that
    were there already (a killed writer's, not this command's)."""

    path: str
    before: tuple[int, int] | None
    partials: frozenset[str]

    def committed(self) -> bool:
        """Whether the command made its output visible: something is at :attr:`path` that was not
        there when it started (an ``--overwrite`` commit moves the old output aside and renames the
        new one in: in between, nothing is there, and the commit counts as made)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return self.before is not None
        return self.before is None or (st.st_dev, st.st_ino) != self.before

    def remove_new_partials(self) -> None:
        """Remove the staging siblings this command made and left (an interrupt can come between a
        staging directory's creation and its writer's taking charge of it), through the output's
        destination (under the parent's writer lock; nothing when another process holds it)."""
        from mfsdp_ckpt.write.destination import destination_for

        destination_for(self.path).discard_staging(keep=self.partials)


_output: _Output | None = None  # what the running command writes (:func:`guard_output`)


def guard_output(path: str) -> None:
    """Note ``path``, the destination the running command writes: once the write has made it
    visible (the rename that commits it), a Ctrl-C no longer stops the command, which reports
    what it wrote and exits 0; a Ctrl-C before then ends it with 130 and leaves no destination and
    none of its staging siblings (:func:`_interrupted`). Locally only: an object store's output
    is committed by its manifest, written last, which nothing here can see."""
    global _output
    from mfsdp_ckpt.storage.fs import normalize
    from mfsdp_ckpt.write.destination import destination_for

    if not is_local(path):
        return
    final = normalize(path)
    try:
        st = os.lstat(final)
        before: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        before = None
    _output = _Output(final, before, destination_for(final).staged_siblings())


def _committed() -> bool:
    """Whether the running command's output is committed (False when it writes none)."""
    return _output is not None and _output.committed()


def _interrupted() -> NoReturn:
    """A Ctrl-C's end of a command: ``error: interrupted``, exit code 130, with nothing at the
    destination: what its writer left of its staging (:meth:`_Output.remove_new_partials`) is
    removed first. A further Ctrl-C changes nothing."""
    settle()
    if _output is not None:
        _output.remove_new_partials()
    _fail("interrupted", "KeyboardInterrupt", 130)


def import_torch() -> None:
    """Import torch (about 2 s; what every command's work needs, and what its refusals do not:
    they come first) with SIGINT held back, under the error boundary. A ``KeyboardInterrupt``
    raised inside torch's import can meet a C++ callback that cannot pass it on (the process
    aborts) or one that swallows it; held back, a Ctrl-C waits until the import is done and is
    ``error: interrupted`` (130) right after it, as is one an earlier import swallowed."""

    def load() -> None:
        held = threading.current_thread() is threading.main_thread()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if held else None
        try:
            import torch  # noqa: F401 - imported for what follows
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    _run(load)


def _run(fn: Callable[[], Any]) -> Any:
    """The error boundary of every command: whatever goes wrong is one line on stderr and exit
    code 1 (130 when interrupted: a ``KeyboardInterrupt``, an error raised while one unwound, such
    as torch's zip writer's ``RuntimeError`` when Ctrl-C lands inside ``torch.save``, or any
    failure after a Ctrl-C, one that an import swallowed included, unless the output is
    committed by then); ``--debug`` shows the traceback instead."""
    from mfsdp_ckpt.errors import (  # here, not at the top: ``--help`` imports no torch
        CheckpointError,
        one_line,
    )

    try:
        if _interrupted_at is not None and not _settled:
            raise KeyboardInterrupt  # noted, then swallowed (by an import): the command stops here
        return fn()
    except KeyboardInterrupt:
        _interrupted()
    except Exception as e:  # the boundary: nothing escapes as a traceback
        if _debug():
            raise
        from mfsdp_ckpt.storage.write_errors import interrupt_behind

        if (_interrupted_at is not None or interrupt_behind(e) is not None) and not _committed():
            _interrupted()
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


#: what ``reshard --dtype`` and ``export-hf --dtype`` may cast weights to: ``CAST_CHOICES`` of
#: :mod:`mfsdp_core.dtypes`, which imports torch (``--help`` and a wrong value answer without it)
CAST_CHOICES = ("float32", "bfloat16", "float16")


# ---- refusals before torch: the library's own checks where they import no torch, its words where
# they live in modules that do (tests/cli/test_ckpt_cli_fast_refusals.py holds the two together)


def is_local(path: str) -> bool:
    """Whether ``path`` is on this machine's file system (not an object store's URL): only there
    are paths checked before torch (an object store needs its libraries)."""
    from mfsdp_ckpt.storage.fs import is_local as local

    return local(path)


def refuse_missing_checkpoint(path: str | None) -> None:
    """Refuse a local checkpoint path (or a run directory, a ``latest`` pointer) that does not
    exist, with the readers' own refusal (``<path>: no such checkpoint``)."""
    from mfsdp_ckpt.storage.fs import normalize

    if path is not None and is_local(path) and not os.path.exists(normalize(path)):
        from mfsdp_ckpt.read.resolve import resolve_checkpoint

        resolve_checkpoint(path)  # raises: nothing is there


def refuse_existing_output(path: str, *, overwrite: bool, kind: str = "checkpoint") -> None:
    """Refuse a local destination that exists when ``--overwrite`` is not given, with the
    writers' own refusal (``<path>: already exists (use --overwrite ...)``). With ``--overwrite``
    the writer decides, once it has read the source, whether what is there may be replaced."""
    from mfsdp_ckpt.storage.fs import normalize

    if not overwrite and is_local(path) and os.path.lexists(normalize(path)):
        from mfsdp_ckpt.write.destination import destination_for

        destination_for(normalize(path), kind=kind).check(overwrite=False)  # raises: something is there


def refuse_any_output(dst: str, src: str, kind: str) -> None:
    """Refuse, as ``convert`` does (it has no ``--overwrite``), a local ``dst`` where anything is
    (``<dst>: already exists``), then one the writer refuses before reading ``src`` (one inside
    it: the destination's own check, given what ``src`` leads to)."""
    from mfsdp_ckpt.errors import CheckpointExistsError
    from mfsdp_ckpt.read.inputs import checkpoint_inputs
    from mfsdp_ckpt.storage.fs import normalize
    from mfsdp_ckpt.write.destination import destination_for

    dst, src = normalize(dst), normalize(src)
    if os.path.exists(dst):
        raise CheckpointExistsError(f"{dst}: already exists")
    destination_for(dst, kind=kind).check(sources=tuple(checkpoint_inputs(src)))


def refuse_output_among_inputs(dst: str, what: str, path: str | None) -> None:
    """Refuse a ``dst`` that would write over, into or around the checkpoint ``path`` (``what``:
    how the message names it, e.g. ``the --plan-from checkpoint``) or the pointer leading to it."""
    from mfsdp_ckpt.read.inputs import checkpoint_inputs
    from mfsdp_ckpt.storage.overlap import check_apart

    if path is not None:
        check_apart(dst, {what: checkpoint_inputs(path)})


def check_key_map(rules: Sequence[str]) -> tuple[str, ...]:
    """``--key-map``'s rules (``OLD=NEW``), a malformed one refused in the words of
    :func:`mfsdp_ckpt.read.stock.parse_key_map` (whose module imports torch)."""
    from mfsdp_ckpt.errors import CheckpointError

    for rule in rules:
        if "=" not in rule:
            raise CheckpointError(
                f"--key-map {rule!r}: expected OLD=NEW (a prefix rename: '=model.' adds 'model.', 'model.=' strips it)"
            )
        if rule == "=":
            raise CheckpointError(f"--key-map {rule!r}: OLD and NEW are both empty")
    return tuple(rules)


def refuse_missing_mcore_config(path: str | None) -> None:
    """Refuse a Megatron-Core arguments file (``--config``, ``--mcore-config``) that is not there,
    in the words of the import that reads it
    (:func:`~mfsdp_ckpt.mcore.config_check.read_mcore_args`)."""
    if path is not None and not os.path.exists(path):
        from mfsdp_ckpt.mcore.config_check import read_mcore_args

        read_mcore_args(path)  # raises: nothing is there


def refuse_unlistable(root: str, mem_tier: str | None) -> None:
    """``ls``'s refusals: a ``--mem-tier`` that is no local directory (an object store: before any
    of its libraries is imported), then a local ROOT that is no directory."""
    from mfsdp_ckpt.tools.listing import check_mem_tier, check_root

    if mem_tier is not None:
        check_mem_tier(mem_tier)
    if is_local(root):
        check_root(root)


#: sizes as :func:`mfsdp_ckpt.hf.files.parse_size` reads them (transformers' ``max_shard_size``)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def check_size(text: str, flag: str) -> None:
    """Refuse a size the writers refuse, in their words: ``--max-shard-size`` as
    :func:`mfsdp_ckpt.hf.files.parse_size` says it, ``--max-file-size`` as
    :func:`mfsdp_ckpt.hf.workers.max_file_bytes` does (both modules import torch)."""
    from mfsdp_ckpt.errors import ConversionError

    m = _SIZE.fullmatch(text.upper())
    if m is not None and int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""]) > 0:
        return
    detail = (
        f"{text!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes" if m is None else f"{text!r} must be positive"
    )
    raise ConversionError(f"max shard size {detail}" if flag == "--max-shard-size" else f"{flag}: {detail}")


def arch_names() -> list[str]:
    """The architectures the HF bridge knows, by the names of the modules of
    :mod:`mfsdp_ckpt.hf.archs` (one per architecture, named as it is; the registry imports them,
    and they import torch), without importing them."""
    spec = importlib.util.find_spec("mfsdp_ckpt.hf.archs")
    where = list(spec.submodule_search_locations or ()) if spec is not None else []
    return sorted(m.name for m in pkgutil.iter_modules(where) if not m.name.startswith("_"))


def check_arch(name: str | None) -> None:
    """Refuse an ``--arch`` the HF bridge does not know, in its words
    (:func:`mfsdp_ckpt.hf.registry.get_architecture`)."""
    from mfsdp_ckpt.errors import ConversionError

    known = arch_names()
    if name is not None and name not in known:
        raise ConversionError(f"unknown architecture {name!r}; known: {', '.join(known)}")


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
