"""The shape of the tree (issue 25): file sizes, no import cycle, what the models may import, and dispatch decisions
kept inside hetmoe/moe/. Static checks over the sources: they read files, import nothing of hetmoe."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hetmoe"
MAX_PY_LINES, MAX_CPP_LINES = 450, 600


def _modules() -> dict:
    """module name -> path, for every .py file of the package."""
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, package: str, top_level_only: bool) -> set:
    """The hetmoe modules ``path`` imports (``from a import b`` counts a.b when that is a module). With
    ``top_level_only`` the imports inside functions and ``if TYPE_CHECKING:`` blocks are left out: those run later
    or never, and cannot make an import cycle."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names.add(base)
                names.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                continue
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and top_level_only:
                continue
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.Try, ast.With,
                                   ast.For, ast.While)):
                visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return {n for n in names if n == "hetmoe" or n.startswith("hetmoe.")}


def test_file_sizes():
    long_py = [f"{p.relative_to(ROOT)}: {n}" for p in PACKAGE.rglob("*.py")
               if (n := len(p.read_text().splitlines())) > MAX_PY_LINES]
    long_cpp = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h", ".cu")
                and (n := len(p.read_text().splitlines())) > MAX_CPP_LINES]
    assert not long_py, f"Python files over {MAX_PY_LINES} lines: {long_py}"
    assert not long_cpp, f"C++ files over {MAX_CPP_LINES} lines: {long_cpp}"


def test_no_import_cycle():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = {d for d in _imports(path, package, top_level_only=True) if d in modules and d != name}
        # importing a.b.c runs a and a.b first: a package's __init__ is a dependency too
        deps |= {".".join(d.split(".")[:i]) for d in deps for i in range(2, d.count(".") + 1)} & set(modules)
        graph[name] = deps - {name} - {p for p in _parents(name)}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _parents(name: str) -> set:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _find_cycle(graph: dict):
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = dfs(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_models_import_only_layers_and_the_moe_layer():
    allowed = ("hetmoe.layers", "hetmoe.moe", "hetmoe.models")
    bad = []
    for path in (PACKAGE / "models").glob("*.py"):
        for dep in _imports(path, "hetmoe.models", top_level_only=False):
            if dep != "hetmoe" and not dep.startswith(allowed):
                bad.append(f"{path.name}: {dep}")
    assert not bad, f"models import beyond layers/ and moe/: {bad}"


@pytest.mark.parametrize("pattern", [r"isinstance\([^)]*Experts", r"hasattr\([^)]*(takes_shared|routes_on_host)"])
def test_dispatch_decisions_live_in_the_moe_package(pattern):
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "moe"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
