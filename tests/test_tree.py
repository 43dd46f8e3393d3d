"""The shape of the tree: packages import one way (imports inside functions counted), no import cycle, no re-export
shim, no private name used across modules, the environment read only in hetmoe/envs.py, what the models may import,
dispatch decisions kept inside hetmoe/moe/. File sizes are reported, never failed. Static checks over the sources:
they read files, import nothing of hetmoe."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hetmoe"
MAX_PY_LINES, MAX_CPP_LINES = 500, 600  # a hint to split by meaning, never a reason to move code

# The packages of hetmoe from the top down: each imports only packages below it (docs/architecture.md). The root
# (``hetmoe``: the version, the lazy names, the compiled ``_C``) may be imported by any of them.
LAYERS = ("__main__", "cli", "server", "tools", "bench", "engine", "transformers", "load", "plan", "models", "moe",
          "layers", "ops", "cpu", "config", "tokenizer", "envs")


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


def _imports(path: Path, package: str, top_level_only: bool, type_checking: bool = False) -> set:
    """The hetmoe modules ``path`` imports (``from a import b`` counts a.b when that is a module). With
    ``top_level_only`` the imports inside functions are left out, and ``if TYPE_CHECKING:`` blocks unless
    ``type_checking``: those run later or never, and cannot make an import cycle."""
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
            elif isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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
    if long_py or long_cpp:  # a hint, not a failure: split a file where its meaning splits
        warnings.warn(f"long files (consider splitting by meaning): {long_py + long_cpp}")


def _package(module: str) -> str:
    """The top-level package of a hetmoe module (``hetmoe.moe.streamed.vram`` -> ``moe``); the root is ``hetmoe``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hetmoe"


def package_edges() -> dict:
    """(importer package, imported package) -> the imports that make the edge, every import counted: top level,
    inside functions and ``if TYPE_CHECKING:`` blocks alike."""
    edges, modules = {}, _modules()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for dep in _imports(path, package, top_level_only=False, type_checking=True) & set(modules):
            a, b = _package(name), _package(dep)
            if a != b and b != "hetmoe":
                edges.setdefault((a, b), set()).add(f"{path.relative_to(ROOT)}: {dep}")
    return edges


def test_packages_import_one_way():
    assert set(LAYERS) == {_package(m) for m in _modules()} - {"hetmoe"}, "a package missing from LAYERS"
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = [f"{a} -> {b}: {sorted(why)[0]}" for (a, b), why in sorted(package_edges().items())
              if rank[a] >= rank[b]]
    assert not upward, "imports against the package order (tests/test_tree.py LAYERS):\n" + "\n".join(upward)


def test_the_edge_finder_counts_lazy_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\ndef f():\n    from hetmoe.cli import main\nif TYPE_CHECKING:\n"
                    "    from hetmoe.server import app\n")
    assert _imports(path, "hetmoe.cpu", top_level_only=False, type_checking=True) >= {"hetmoe.cli", "hetmoe.server"}
    assert _imports(path, "hetmoe.cpu", top_level_only=True) == set()


def _defined_and_imported(path: Path) -> tuple:
    """The names a module defines at its top level, and those it imports there (name -> source module)."""
    defined, imported = set(), {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and node.col_offset == 0 and (node.module or "").startswith("hetmoe"):
            imported.update({a.asname or a.name: node.module for a in node.names})
    return defined, imported


def _from_imports():
    """(importing file, module, name) of every ``from hetmoe... import name`` in the package."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetmoe") and not node.level:
                for alias in node.names:
                    yield path, node.module, alias.name


def test_no_re_export_shims():
    # A name is imported from the module that defines it; a package's __init__ may gather its public names.
    modules = _modules()
    shims = []
    for path, module, name in _from_imports():
        target = modules.get(module)
        if target is None or target.name == "__init__.py" or f"{module}.{name}" in modules:
            continue
        defined, imported = _defined_and_imported(target)
        if name not in defined and name in imported:
            shims.append(f"{path.relative_to(ROOT)}: {name} from {module} (defined in {imported[name]})")
    assert not shims, "\n".join(shims)


def test_no_private_name_across_modules():
    modules = _modules()
    private = [f"{path.relative_to(ROOT)}: {module}.{name}" for path, module, name in _from_imports()
               if name.startswith("_") and not name.startswith("__") and name != "_C"
               and f"{module}.{name}" not in modules]
    assert not private, "\n".join(private)


def test_environment_read_only_in_envs():
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "envs.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv|putenv", line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "read the environment through hetmoe/envs.py:\n" + "\n".join(hits)
    reads = [f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h")
             for m in re.findall(r"getenv\(\s*\"?(\w*)", p.read_text())]
    assert all(r.endswith("HETMOE_MAX_ISA") for r in reads) and len(reads) <= 1, reads


def test_every_variable_named_in_the_package_is_declared():
    declared = set(re.findall(r'Var\("(\w+)"', (PACKAGE / "envs.py").read_text()))
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bHETMOE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    for path in (p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h")):  # C++ macros are not variables
        named |= set(re.findall(r'"(HETMOE_[A-Z][A-Z0-9_]*[A-Z0-9])', path.read_text()))
    assert named <= declared, f"named but not declared in hetmoe/envs.py: {sorted(named - declared)}"


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


def test_models_import_only_layers_ops_and_the_moe_layer():
    allowed = ("hetmoe.layers", "hetmoe.moe", "hetmoe.models", "hetmoe.ops")
    bad = []
    for path in (PACKAGE / "models").glob("*.py"):
        for dep in _imports(path, "hetmoe.models", top_level_only=False):
            if dep != "hetmoe" and not dep.startswith(allowed):
                bad.append(f"{path.name}: {dep}")
    assert not bad, f"models import beyond layers/, ops/ and moe/: {bad}"


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


def test_every_variable_is_documented():
    declared = set(re.findall(r'Var\("(\w+)"', (PACKAGE / "envs.py").read_text()))
    documented = (ROOT / "docs" / "running.md").read_text()
    assert declared and all(f"`{name}`" in documented for name in declared), \
        f"not in docs/running.md#environment-variables: {sorted(n for n in declared if f'`{n}`' not in documented)}"


def test_tests_mirror_the_package_folders():
    tests = ROOT / "tests"
    folders = sorted(d.relative_to(tests) for d in tests.rglob("*") if d.is_dir() and d.name != "__pycache__"
                     and any(d.glob("test_*.py")))
    stray = [str(d) for d in folders if not (PACKAGE / d).is_dir()]
    assert folders and not stray, f"test folders with no package folder of that name: {stray}"


def test_test_files_have_unique_names():
    """pytest imports test files by their base name (the folders are not packages): two files of one name in
    different folders stop the collection of the whole suite ("import file mismatch")."""
    seen: dict = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
