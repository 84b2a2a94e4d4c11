"""Two rules of the code's shape that a linter does not check: every function of the checkpoint
package and the command line does one thing (none is over 80 lines, docstring included), and
only one module of ``mfsdp_ckpt`` knows the reference model (``sharded/model_shape``): the
bridges and tools reach a model's shape through the checkpoint's recorded model source."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 80
REFERENCE_MODEL = "mfsdp_core.models.gpt"
SHAPE_SEAM = os.path.join("mfsdp_ckpt", "sharded", "model_shape.py")


def _files(*packages: str) -> list[str]:
    out = []
    for package in packages:
        for directory, _, names in os.walk(os.path.join(ROOT, package)):
            out += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    return sorted(out)


def _tree(path: str) -> ast.AST:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def test_no_function_is_longer_than_80_lines():
    long = [
        f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in _files("mfsdp_ckpt", "cli")
        for node in ast.walk(_tree(path))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], "\n".join(long)


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_only_the_shape_seam_imports_the_reference_model():
    importers = [
        os.path.relpath(path, ROOT)
        for path in _files("mfsdp_ckpt")
        if any(name == REFERENCE_MODEL or name.startswith(REFERENCE_MODEL + ".") for name in _imports(_tree(path)))
    ]
    assert importers == [SHAPE_SEAM], importers


def test_the_checks_see_what_they_are_meant_to():
    """The seam itself is found (the scan reads the real tree), and a long function would be."""
    assert REFERENCE_MODEL in _imports(_tree(os.path.join(ROOT, SHAPE_SEAM)))
    body = "\n".join(["def f():"] + ["    x = 1"] * MAX_FUNCTION_LINES)
    node = ast.parse(body).body[0]
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
