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
        if pattern in (ROOT / path).read_text() and path != "mfsdp_ckpt/errors.py"
    }
    assert not copies, sorted(copies)


def _sources() -> list[str]:
    """mfsdp_ckpt/ and cli/, as paths relative to the repository."""
    return [p.relative_to(ROOT).as_posix() for d in ("mfsdp_ckpt", "cli") for p in sorted((ROOT / d).rglob("*.py"))]


# ---- data-file names in format/names.py -----------------------------------------------------------


def _code_strings(tree: ast.Module) -> list[str]:
    """The string constants of ``tree`` but its docstrings (f-strings' literal parts included)."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_data_file_names_are_built_in_format_names():
    from mfsdp_ckpt.format.names import dcp_data_file, dcp_data_file_rank

    assert dcp_data_file(3, 4) == "__3_4.distcp" and dcp_data_file(0) == "__0_0.distcp"
    assert dcp_data_file_rank("dir/__12_3.distcp") == 12 and dcp_data_file_rank("__1_2.distcpx") is None
    builders = sorted(
        path
        for path in _sources()
        if path != "mfsdp_ckpt/format/names.py"
        and any(".distcp" in s or s == "__" for s in _code_strings(ast.parse((ROOT / path).read_text())))
    )
    assert not builders, builders


# ---- the offline commands import public faces ------------------------------------------------------

#: what the command line may import of mfsdp_ckpt: its public faces
PUBLIC_FACES = {"mfsdp_ckpt", "mfsdp_ckpt.errors", "mfsdp_ckpt.hf", "mfsdp_ckpt.mcore", "mfsdp_ckpt.tools"}


def test_the_offline_commands_import_public_faces_only():
    inner = set()
    for name in ("main.py", "hf.py", "mcore.py"):
        for node in ast.walk(ast.parse((ROOT / "cli" / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mfsdp_ckpt"):
                inner |= {(name, node.module)} - {(name, face) for face in PUBLIC_FACES}
    assert not inner, sorted(inner)


def test_the_tools_face_is_lazy_and_gives_the_functions(monkeypatch):
    import subprocess
    import sys

    code = "import sys, mfsdp_ckpt.tools as t; assert 'torch' not in sys.modules, 'torch imported'; print(t.__all__)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    import mfsdp_ckpt.tools as tools
    import mfsdp_ckpt.tools.convert  # noqa: F401 - sets the package's attribute: still the function
    import mfsdp_ckpt.tools.inspect as inspect_module

    for name in ("convert", "upcycle"):  # the functions, not the submodules of their names
        assert getattr(tools, name) is getattr(sys.modules[f"mfsdp_ckpt.tools.{name}"], name), name
    for name in tools.__all__:
        assert getattr(tools, name) is not None, name
    monkeypatch.setattr(inspect_module, "inspect_checkpoint", len)
    assert tools.inspect_checkpoint is len  # looked up anew: a replaced function is seen


# ---- the public entry points say what each argument is ----------------------------------------------

ENTRY_POINTS = [
    ("mfsdp_ckpt/sharded/load.py", "load"),
    ("mfsdp_core/fully_shard.py", "fully_shard"),
    ("mfsdp_core/optim.py", "fully_shard_optimizer"),
    ("mfsdp_ckpt/hf/import_.py", "import_"),
    ("mfsdp_ckpt/sharded/save.py", "save"),
    ("mfsdp_ckpt/sharded/async_save.py", "async_save"),
    ("mfsdp_ckpt/hf/export.py", "export"),
]


def test_the_public_entry_points_have_an_args_section_naming_every_parameter():
    missing = []
    for path, name in ENTRY_POINTS:
        tree = ast.parse((ROOT / path).read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        doc = ast.get_docstring(fn) or ""
        args = doc.partition("\nArgs:\n")[2].partition("\nReturns:\n")[0]
        params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
        missing += [f"{name}({p})" for p in params if not args or f"    {p}:" not in args and f" {p}," not in args]
        missing += [f"{name}: no Returns" for _ in [0] if "\nReturns:\n" not in doc]
    assert not missing, missing
