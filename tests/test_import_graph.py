"""The import graph of the project's packages has no cycle and points one way.

Every ``import`` counts, at module level or inside a function (a function-level import hides a
cycle; it does not remove it), except those under ``if TYPE_CHECKING:``, which never run. Importing
``a.b.c`` also imports the packages ``a`` and ``a.b`` (their ``__init__``), so those are edges too,
unless the importer is inside them (they are then already being imported). The directions:
the runtime (``mfsdp_core``) imports neither the checkpoint layer nor the command line, and the
checkpoint layer (``mfsdp_ckpt``) does not import the command line; its ``format`` layer imports
nothing that imports ``torch.distributed``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mfsdp_core", "mfsdp_ckpt", "cli")
#: package -> the packages it must never import
FORBIDDEN = {"mfsdp_core": ("mfsdp_ckpt", "cli"), "mfsdp_ckpt": ("cli",)}
#: the layers of ``mfsdp_ckpt``, bottom first (docs/checkpoint.md): each imports only those before
#: it (and itself); ``errors`` and ``progress`` are under all of them, the package's ``__init__``
#: (the public API) above all
CKPT_LAYERS = (
    "errors",
    "progress",
    "format",
    "model",
    "storage",
    "read",
    "write",
    "sharded",
    "tier",
    "hf",
    "mcore",
    "tools",
)


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of :data:`PACKAGES`."""
    out = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(directory, name)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules importing it imports (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        skipped = _type_checking_only(tree)
        package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    graph[module].add(sub if sub in modules else target)
    for module, targets in graph.items():
        for target in list(targets):
            parts = target.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in modules and not (module == parent or module.startswith(parent + ".")):
                    targets.add(parent)
        targets &= set(modules)
        targets.discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(group) for group in found)


def test_imports_point_one_way():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if any(target.split(".")[0] == banned for banned in FORBIDDEN.get(module.split(".")[0], ()))
    )
    assert not wrong, "; ".join(wrong)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "mfsdp_ckpt":
        return None
    return len(CKPT_LAYERS) if len(parts) == 1 else CKPT_LAYERS.index(parts[1])


def test_the_checkpoint_layers_import_downwards_only():
    assert sorted(n for n in os.listdir(os.path.join(ROOT, "mfsdp_ckpt")) if not n.startswith(("_", "."))) == sorted(
        f"{layer}.py" if layer in ("errors", "progress") else layer for layer in CKPT_LAYERS
    ), "a module or subpackage of mfsdp_ckpt that is not in a layer"
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if _layer(module) is not None
        for target in targets
        if _layer(target) is not None and _layer(target) > _layer(module)
    )
    assert not upward, "; ".join(upward)


def test_every_imported_name_exists():
    """Every ``from <project module> import name`` anywhere in the project, tests and benchmarks
    included (function-level imports too, which run only when their function does), names
    something the module has: a moved or renamed symbol fails here, not in the one run that
    reaches it."""
    import importlib

    missing = []
    for directory in (*PACKAGES, "tests", "bench", "fixtures"):
        for folder, _, files in os.walk(os.path.join(ROOT, directory)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                package = os.path.relpath(folder, ROOT).split(os.sep)
                for node in ast.walk(tree):
                    if not isinstance(node, ast.ImportFrom):
                        continue
                    if node.level:
                        base = package[: len(package) - (node.level - 1)]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    if target.split(".")[0] not in PACKAGES:
                        continue
                    module = importlib.import_module(target)
                    for alias in node.names:
                        if alias.name != "*" and not hasattr(module, alias.name):
                            try:
                                importlib.import_module(f"{target}.{alias.name}")
                            except ImportError:
                                missing.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {target}.{alias.name}")
    assert not missing, "; ".join(missing)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


#: the modules of the pure format layer (its package included)
FORMAT_MODULES = sorted(m for m in _modules() if m == "mfsdp_ckpt.format" or m.startswith("mfsdp_ckpt.format."))


def _imports_collectives(path: str) -> bool:
    """Whether the file imports ``torch.distributed`` (or a submodule), outside ``TYPE_CHECKING``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[:2] == ["torch", "distributed"] for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[:2] == ["torch", "distributed"]:
                return True
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                return True
    return False


def test_the_format_reaches_no_collectives():
    """``format`` is pure (docs/checkpoint.md): no module it imports, directly or through others,
    at module level or in a function, imports ``torch.distributed``."""
    graph, modules = import_graph(), _modules()
    wrong = []
    for start in FORMAT_MODULES:
        chains, todo = {start: [start]}, [start]
        while todo:
            module = todo.pop()
            if _imports_collectives(modules[module]):
                wrong.append(" -> ".join(chains[module]) + " (imports torch.distributed)")
                break
            for target in sorted(graph[module] - chains.keys()):
                chains[target] = chains[module] + [target]
                todo.append(target)
    assert not wrong, "; ".join(wrong)


@pytest.mark.parametrize("module", FORMAT_MODULES)
def test_importing_the_format_leaves_torch_distributed_out(module):
    """Importing any module of ``format`` in a fresh interpreter leaves ``torch.distributed``
    unimported. ``import torch`` itself imports it (torch 2.13), so these modules import torch,
    and the runtime's modules that import it, only inside the functions that handle tensors."""
    code = f"import sys, {module}; print('torch.distributed' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} imports torch.distributed"
