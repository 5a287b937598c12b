"""Which top-level packages may import which (read from the source with `ast`, nothing is imported):

- `benchmarks` may import `loadtests` (the local cluster harness of `loadtests.run`, the browser driver of
  `loadtests.playground`), never the reverse: helpers both need live in the one that owns them or below, in `ciar`
  (e.g. `ciar.results.write_results`);
- `ciar`, the library under both, imports neither of them, nor `services`, nor Ray.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {"loadtests": ("benchmarks",), "ciar": ("benchmarks", "loadtests", "services", "ray")}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in `tree`, at any depth (functions included), and every
    `importlib.import_module` / `__import__` of a constant name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def python_files(package: str) -> list[str]:
    root = os.path.join(REPO, package)
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) if "__pycache__" not in d
                  for f in files if f.endswith(".py"))


def violations(package: str) -> list[str]:
    bad = []
    for path in python_files(package):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for line, module in imported_modules(tree):
            if module.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{os.path.relpath(path, REPO)}:{line}: {module}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    assert python_files(package), package
    assert violations(package) == [], f"{package} may not import {', '.join(FORBIDDEN[package])}"


def test_the_check_sees_every_kind_of_import():
    tree = ast.parse("import benchmarks\nimport benchmarks.collab as c\nfrom benchmarks.collab import x\n"
                     "def f():\n    from benchmarks import gpu\n    importlib.import_module('benchmarks.decode')\n"
                     "from . import run\nfrom .run import Cluster\n")
    assert sorted(m for _, m in imported_modules(tree)) == ["benchmarks", "benchmarks", "benchmarks.collab",
                                                            "benchmarks.collab", "benchmarks.decode"]


def module_graph(package: str) -> dict[str, set[str]]:
    """package's modules -> the modules of the same package each imports (at any depth, as above)."""
    mods = {os.path.relpath(p, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__"): p
            for p in python_files(package)}
    graph = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        names = [name for _, name in imported_modules(tree)]
        for node in ast.walk(tree):  # `from pkg import submodule` imports the submodule
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
        deps = set()
        for name in names:
            while name and name not in mods:  # `from loadtests.run import Cluster` -> loadtests.run
                name = name.rpartition(".")[0]
            if name and name != mod and name != package and not mod.startswith(name + "."):
                deps.add(name)  # (a module's own package runs first anyway: not an edge back to it)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle (one path each), by depth-first search."""
    found, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


@pytest.mark.parametrize("package", ["loadtests", "services", "benchmarks"])
def test_no_import_cycles_between_modules(package):
    assert cycles(module_graph(package)) == []


def test_the_cycle_check_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
