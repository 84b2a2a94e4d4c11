"""Two rules of the code's shape that a linter does not check: every function of the checkpoint
package and the command line does one thing (none is over 80 lines, docstring included), and
only one module of ``mfsdp_ckpt`` knows the reference model (``model/shape``): the
bridges and tools reach a model's shape through the checkpoint's recorded model source."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 80
REFERENCE_MODEL = "mfsdp_core.models.gpt"
SHAPE_SEAM = os.path.join("mfsdp_ckpt", "model", "shape.py")


def _files(*packages: str) -> list[str]:
    out = []
    for package in packages:
        for directory, _, names in os.walk(os.path.join(ROOT, package)):
            out += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    return sorted(out)


def _tree(path: str) -> ast.AST:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _long_functions(paths: list[str]) -> list[str]:
    """``file:line name (n lines)`` of every function over :data:`MAX_FUNCTION_LINES` in ``paths``."""
    return [
        f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in paths
        for node in ast.walk(_tree(path))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _reference_model_importers(paths: list[str]) -> list[str]:
    """The files of ``paths`` that import the reference model (at module level or in a function)."""
    return [
        os.path.relpath(path, ROOT)
        for path in paths
        if any(name == REFERENCE_MODEL or name.startswith(REFERENCE_MODEL + ".") for name in _imports(_tree(path)))
    ]


def test_no_function_is_longer_than_80_lines():
    long = _long_functions(_files("mfsdp_ckpt", "cli"))
    assert long == [], "\n".join(long)


def test_only_the_shape_seam_imports_the_reference_model():
    assert _reference_model_importers(_files("mfsdp_ckpt")) == [SHAPE_SEAM]


def test_the_scans_catch_what_they_look_for(tmp_path):
    """Run on files made to break each rule (and on ones that keep it), the scans report exactly
    the breaking ones: a long nested function, and the reference model imported three ways."""
    long = tmp_path / "long.py"
    long.write_text("class C:\n    def f(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES)
    short = tmp_path / "short.py"
    short.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    assert [line.rsplit(" ", 3)[1:] for line in _long_functions([str(long), str(short)])] == [
        ["f", f"({MAX_FUNCTION_LINES + 1}", "lines)"]
    ]
    ways = {
        "a.py": "from mfsdp_core.models.gpt import GPTConfig\n",
        "b.py": "def f():\n    import mfsdp_core.models.gpt\n",
        "c.py": "from mfsdp_core.models import gpt\n",
        "d.py": "from mfsdp_core.models import mcore\nimport mfsdp_core\n",
    }
    for name, text in ways.items():
        (tmp_path / name).write_text(text)
    found = _reference_model_importers([str(tmp_path / name) for name in sorted(ways)])
    assert [os.path.basename(f) for f in found] == ["a.py", "b.py", "c.py"]
