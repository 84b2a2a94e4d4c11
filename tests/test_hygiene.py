"""One home for each rule the package applies in many places (issue 53): the public exception
classes live in ``mfsdp_ckpt/errors.py``. Read from the source with ``ast`` (nothing imported)."""

from __future__ import annotations

import ast
import builtins
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mfsdp_ckpt"

#: exception classes that stay beside the code that raises them, with the reason
ALLOWED_ELSEWHERE = {
    # a signal between the threads of one worker pool, caught there and never raised to a caller
    ("mfsdp_ckpt/hf/workers.py", "Cancelled"),
    # the write path's own: moved by the write-path rewrite of issue 53 (remove these then)
    ("mfsdp_ckpt/write/job.py", "JobFailedElsewhere"),
    ("mfsdp_ckpt/write/job.py", "JobLostError"),
    ("mfsdp_ckpt/write/agreement.py", "JobFailedElsewhere"),
    ("mfsdp_ckpt/write/agreement.py", "JobLostError"),
}


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _exception_classes(modules: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(file, class) of every top-level class deriving from an exception, by base name (to a fixed point)."""
    known = {
        n
        for n in dir(builtins)
        if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
    }
    found: set[tuple[str, str]] = set()
    while True:
        new = {
            (path, node.name)
            for path, tree in modules.items()
            for node in tree.body
            if isinstance(node, ast.ClassDef) and any(_base_name(b) in known for b in node.bases)
        }
        if new == found:
            return found
        found = new
        known |= {name for _, name in found}


def test_public_exception_classes_live_in_errors_py():
    outside = {
        (path, name)
        for path, name in _exception_classes(_modules())
        if path != "mfsdp_ckpt/errors.py" and not name.startswith("_")
    }
    assert outside <= ALLOWED_ELSEWHERE, sorted(outside - ALLOWED_ELSEWHERE)


# ---- one helper for one-line error text ---------------------------------------------------------

#: the write path's own copies, left to the write-path rewrite of issue 53 (remove these then)
ONE_LINE_PENDING = ("mfsdp_ckpt/write/", "mfsdp_ckpt/sharded/async_save.py", "mfsdp_ckpt/mcore/import_.py")
ONE_LINE_COPIES = ('" ".join(str(', ".split())[:", 'splitlines() or [""])[0]', "def _one_line(")


def test_one_line_collapses_cuts_and_keeps_the_first_line():
    from mfsdp_ckpt.errors import one_line

    assert one_line(ValueError("a  b\n\tc ")) == "a b c"
    assert one_line("x" * 10, 4) == "xxxx" and one_line("x" * 10, 4, mark="...") == "xxxx..."
    assert one_line("short", 5, mark="...") == "short"
    assert one_line("\n first  line \nsecond", first_line=True) == "first line"
    assert one_line("") == "" and one_line("", first_line=True) == ""


def test_one_line_text_is_made_in_one_place():
    copies = {
        (path, pattern)
        for path in _sources()
        for pattern in ONE_LINE_COPIES
        if pattern in (ROOT / path).read_text() and not path.startswith(ONE_LINE_PENDING + ("mfsdp_ckpt/errors.py",))
    }
    assert not copies, sorted(copies)


def _sources() -> list[str]:
    """mfsdp_ckpt/ and cli/, as paths relative to the repository."""
    return [p.relative_to(ROOT).as_posix() for d in ("mfsdp_ckpt", "cli") for p in sorted((ROOT / d).rglob("*.py"))]
