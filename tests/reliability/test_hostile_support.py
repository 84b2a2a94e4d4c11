"""Helpers for the hostile-checkpoint tests (no tests here): a small real checkpoint written in
one process, rewriting its manifest or ``.metadata`` as a hostile writer would, a deadline that
turns a hang into a failure, and an audit of every file the readers open.

The helpers compute the manifest checksum themselves (crc32c of the canonical JSON of every other
field, as docs/checkpoint.md describes) rather than importing it, so the tests state the format,
not the implementation."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Callable, Iterator

import google_crc32c
import torch

import mfsdp_ckpt
from mfsdp_core.models.gpt import PRESETS
from tests.mfsdp_ckpt.util import as_listed, build

MODEL_CONFIG = PRESETS["tiny"].to_dict()  # what the trainer's --resume check compares against
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trained_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The test MLP, sharded in one process, after one optimizer step (so it has state)."""
    model, optim = build("optim_grads_params", "even", name="mlp")
    torch.manual_seed(1)
    model(torch.randn(3, 13)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def save_small(path: str, step: int = 1, model=None, optim=None, listed: bool = True, **kwargs: Any) -> str:
    """A committed checkpoint of the test MLP at ``path`` (one process, one data file). ``listed``
    (the default here): its manifest rewritten in the listed form (``as_listed``), whose readers
    take ``.metadata`` and the chunk table, the targets of most hostile edits; without it, as
    ``save`` wrote it (an index; see test_hostile_index.py)."""
    if model is None:
        model, optim = trained_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        out = mfsdp_ckpt.save(
            path, model, optim, extra={"step": step, "data_position": 0}, step=step, model_config=MODEL_CONFIG, **kwargs
        )
    return as_listed(out) if listed else out


def manifest_crc(manifest: dict) -> int:
    """crc32c of the canonical JSON of every field but ``manifest_crc32c``."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32c"}
    return google_crc32c.value(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def read_json(path: str) -> dict:
    with open(os.path.join(path, "mfsdp.json")) as f:
        return json.load(f)


def write_json(path: str, manifest: Any, seal: str = "reseal") -> None:
    """Write ``manifest`` as ``mfsdp.json``: ``reseal`` recomputes its checksum (a writer that
    knows the format), ``stale`` keeps whatever checksum it holds (an edit or a flipped byte),
    ``unprotected`` drops the checksums and marks it format version 1 (as written before them)."""
    target = os.path.join(path, "mfsdp.json")
    if os.path.lexists(target):
        os.remove(target)  # a new file: never write into one that may be hard-linked elsewhere
    if isinstance(manifest, str):  # raw text (e.g. nesting too deep for json.dumps)
        with open(target, "w") as f:
            f.write(manifest)
        return
    if isinstance(manifest, dict):
        manifest = dict(manifest)
        if seal == "reseal":
            manifest["manifest_crc32c"] = manifest_crc(manifest)
        elif seal == "unprotected":
            for k in ("manifest_crc32c", "metadata_crc32c"):
                manifest.pop(k, None)
            manifest["format_version"] = 1
    with open(target, "w") as f:
        f.write(json.dumps(manifest, indent=1))


class Replace:
    """What an edit returns to replace the whole manifest (a list, raw text) instead of changing
    it in place."""

    def __init__(self, value: Any) -> None:
        self.value = value


def edit_manifest(path: str, edit: Callable[[dict], Any], seal: str = "reseal") -> None:
    """Apply ``edit`` to the manifest (in place, or returning a :class:`Replace`) and write it."""
    manifest = read_json(path)
    out = edit(manifest)
    write_json(path, out.value if isinstance(out, Replace) else manifest, seal)


def read_metadata(path: str) -> Any:
    """The checkpoint's ``.metadata`` (the test's own file: a plain unpickle is safe here)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def write_metadata(path: str, metadata: Any, seal: str = "reseal") -> None:
    """Write ``.metadata``; with ``reseal`` the manifest records the new file's checksum (a
    writer that knows the format), with ``stale`` it keeps the old one, ``unprotected`` rewrites
    the manifest without checksums (format version 1)."""
    data = pickle.dumps(metadata)
    os.remove(os.path.join(path, ".metadata"))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(data)
    if seal == "stale" or not os.path.exists(os.path.join(path, "mfsdp.json")):
        return
    manifest = read_json(path)
    if seal == "reseal" and "metadata_crc32c" in manifest:
        manifest["metadata_crc32c"] = google_crc32c.value(data)
    write_json(path, manifest, seal)


def fresh_copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ---- hangs and file access --------------------------------------------------------------------


class Hang(BaseException):
    """A reader ran past its deadline (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in this (main) thread after ``seconds``: a blocking ``open`` of a FIFO
    is interrupted too. Tests using it take ``@pytest.mark.timeout(..., method="thread")`` so that
    pytest-timeout leaves SIGALRM alone."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit events that change the file system: the (path, dir_fd) argument positions of what they change
_CHANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.link": ((1, 3),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "shutil.rmtree": ((0, 1),),
    "shutil.move": ((0, None), (1, None)),
    "shutil.copyfile": ((1, None),),
}


def _resolved(path: Any, dir_fd: Any) -> str | None:
    """The real path an audited call acts on (relative to ``dir_fd`` when one is given)."""
    if isinstance(path, int):
        path, dir_fd = "", path
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)


class FileAudit:
    """Records, while :meth:`watching`, every file opened outside the given directories (after
    resolving symlinks; Python's and the repository's own modules excepted) and every open for
    writing or change to the file system anywhere: readers only read inside the checkpoint."""

    def __init__(self) -> None:
        self.roots: tuple[str, ...] | None = None
        self.writable: tuple[str, ...] = ()
        self.violations: list[str] = []
        self._busy = False
        system = {sys.prefix, sys.base_prefix, sys.exec_prefix, ROOT}
        self.system = tuple(sorted({os.path.realpath(p) for p in system}))
        sys.addaudithook(self._hook)

    @contextlib.contextmanager
    def watching(self, *roots: str, writable: tuple[str, ...] = ()) -> Iterator[list[str]]:
        """Record violations while inside: reads outside ``roots``, writes outside ``writable``."""
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self.writable = tuple(os.path.realpath(r) for r in writable)
        self.violations = []
        try:
            yield self.violations
        finally:
            self.roots, self.writable = None, ()

    def _inside(self, path: str, roots: tuple[str, ...]) -> bool:
        return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    def _hook(self, event: str, args: tuple) -> None:
        if self.roots is None or self._busy:
            return
        self._busy = True
        try:
            if event == "open":
                path, mode, flags = (tuple(args) + (None, None))[:3]
                if isinstance(path, int):
                    return
                real = os.path.realpath(os.fsdecode(path))
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & _WRITE_FLAGS
                )
                if writes and not self._inside(real, self.writable):
                    self.violations.append(f"opened for writing: {real}")
                elif not self._inside(real, self.roots + self.system + self.writable):
                    self.violations.append(f"read outside the checkpoint: {real}")
            elif event in _CHANGES:
                paths = [
                    _resolved(args[i], args[d] if d is not None and d < len(args) else None) for i, d in _CHANGES[event]
                ]
                if not all(p is not None and self._inside(p, self.writable) for p in paths):
                    self.violations.append(f"{event}: {paths}")
        finally:
            self._busy = False


AUDIT = FileAudit()


# one interpreter runs every case: ``[(id, tool, argv)]`` as JSON on stdin (tool: ``train`` for the
# trainer's front end, its rank launch replaced by a failure so that only a launcher refusal passes;
# ``ckpt`` for ``mfsdp-ckpt``), ``{id: result}`` on stdout: ``rc``, ``stderr``, ``hung`` (past the
# deadline), ``crash`` (an exception that escaped), ``torch`` (imported by then)
_CLI_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, signal, sys
    import cli.train

    class Hung(BaseException):
        pass

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was launched: the launcher accepted the run")

    def on_alarm(signum, frame):
        raise Hung()

    cli.train.launch = no_launch
    signal.signal(signal.SIGALRM, on_alarm)
    results = {}
    for case_id, tool, argv in json.load(sys.stdin):
        out, err = io.StringIO(), io.StringIO()
        result = {"hung": False, "crash": None}
        signal.alarm(DEADLINE)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                if tool == "train":
                    result["rc"] = cli.train.main(argv)
                else:
                    from cli.main import main
                    try:
                        main(argv, standalone_mode=True)
                        result["rc"] = 0
                    except SystemExit as e:
                        result["rc"] = e.code
        except Hung:
            result["hung"] = True
        except BaseException as e:
            result["crash"] = repr(e)[:300]
        finally:
            signal.alarm(0)
        result["stderr"] = err.getvalue()
        result["torch"] = "torch" in sys.modules  # imported by this case or an earlier one
        results[case_id] = result
    print(json.dumps(results))
    """
)


def run_capped(
    args: list[str], cap: int, *, input: str | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python *args`` from the project root under an address-space cap of ``cap`` bytes
    (``RLIMIT_AS``): an input that makes a reader allocate what it declares fails the test instead
    of swapping the machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        input=input,
        env=env,
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli_cases(cases: list[tuple[str, str, list[str]]], cap: int, deadline: int = 120) -> dict[str, dict[str, Any]]:
    """Every case's result (see :data:`_CLI_DRIVER`), all run in one interpreter under ``cap``, each
    with ``deadline`` seconds."""
    driver = _CLI_DRIVER.replace("DEADLINE", str(deadline))
    out = run_capped(["-c", driver], cap, input=json.dumps(cases), timeout=deadline * len(cases) + 120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
