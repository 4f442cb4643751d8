"""The product's modules import each other without cycles, and its packages one way
(docs/design/request-path.md). Every import counts: at module level, inside functions and
under TYPE_CHECKING alike, read from the source."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# package -> the product packages it may import
DIRECTIONS = {
    "gateway": {"tenants", "policies", "engine"},
    "engine": {"kvstore"},
    "kvstore": set(),
    "tenants": set(),
    "policies": {"tenants"},  # its policy records; the store client is handed to it
}


def product_packages() -> list[str]:
    """The packages pyproject.toml ships (its setuptools `include` patterns)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in include})


def modules_of(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, a package's `__init__.py` named as the package."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` is, or the innermost known package holding it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `module` imports anywhere in its source: `from a import b` counts
    as an import of a.b where that is a module, else of a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else _known(base, modules))
    return {m for m in found if m is not None and m != module}


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    modules = modules_of(root, packages)
    return {m: imports_of(m, path, modules) for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each set of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(sorted(group)[0], group, graph) for group in groups]


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path start -> ... -> start inside `group`."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph(ROOT, product_packages())
    assert len(graph) > 100
    found = [" -> ".join(cycle) for cycle in cycles(graph)]
    assert not found, found


def test_packages_import_one_way():
    assert set(product_packages()) == set(DIRECTIONS)
    wrong = sorted(
        f"{m} -> {dep}"
        for m, deps in import_graph(ROOT, product_packages()).items()
        for dep in deps
        if dep.split(".")[0] != m.split(".")[0]
        and dep.split(".")[0] not in DIRECTIONS[m.split(".")[0]]
    )
    assert not wrong, wrong


def test_cycles_through_any_kind_of_import_are_found(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from pkg import a, e\n",
        "pkg/e.py": "from .sub import x\n",
        "pkg/sub/__init__.py": "from pkg.sub.x import X\n",
        "pkg/sub/x.py": "from ..e import Y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.d"] == {"pkg.a", "pkg.e"}
    assert graph["pkg.sub"] == {"pkg.sub.x"}
    assert sorted(cycles(graph)) == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ["pkg.e", "pkg.sub.x", "pkg.e"],
    ]
